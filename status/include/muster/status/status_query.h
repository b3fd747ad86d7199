// The body of `rdzvd status` and `launch status`: ask a rendezvous server for its runs
// (GetStatus) and print them (docs/operations.md, "Status").
#pragma once

#include <chrono>
#include <string>
#include <string_view>

#include "muster/ops/endpoint.h"
#include "muster/rendezvous/tls.h"

namespace CLI {
class App;
}

namespace muster::status {

// Bounds and defaults (docs/operations.md): the whole call (name lookup, connect, answer)
// gives up after kStatusTimeout; an endpoint without a port means kDefaultStatusPort.
inline constexpr std::chrono::milliseconds kStatusTimeout{5000};
inline constexpr int kDefaultStatusPort = ops::kDefaultRendezvousPort;

struct StatusQuery {
  std::string endpoint;  // HOST[:PORT] or [IPV6][:PORT]
  std::string run_id;    // empty: every run
  std::string token;
  bool json = false;
  std::chrono::milliseconds timeout = kStatusTimeout;
  // A TLS server (docs/operations.md, "TLS"): its CA, and a client certificate for mutual
  // TLS; the name checked defaults to the endpoint's host. No CA: plaintext.
  rendezvous::ClientTlsFiles tls;
};

// The TLS options both commands take: --tls_ca, --tls_cert, --tls_key, --tls_server_name
// (or $MUSTER_TLS_CA, $MUSTER_TLS_CERT, $MUSTER_TLS_KEY, $MUSTER_TLS_SERVER_NAME).
void add_status_tls_options(CLI::App& app, StatusQuery& query);

// Prints the status table (or with `json` one JSON document) on stdout and returns 0. On an
// error prints one line "<prog>: error: ..." on stderr and returns 1 (server unreachable
// within the timeout, token refused, unknown run) or 2 (an endpoint that does not parse).
int print_status(const StatusQuery& query, std::string_view prog);

}  // namespace muster::status
