#include "muster/status/status_query.h"

#include <CLI/CLI.hpp>
#include <cstdio>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "muster/ops/endpoint.h"
#include "muster/status/status_format.h"
#include "muster/rendezvous/client.h"
#include "muster/rendezvous/resolve.h"

namespace muster::status {

using namespace muster::ops;
namespace {

absl::StatusOr<HostPort> parse_host_port(const std::string& text) {
  auto hp = ops::parse_host_port(text, kDefaultStatusPort, 1);
  if (!hp.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("endpoint '", text, "' ", hp.status().message(), " (expected HOST:PORT)"));
  }
  return hp;
}

int error(std::string_view prog, absl::string_view what, int code) {
  std::fprintf(stderr, "%.*s: error: %.*s\n", static_cast<int>(prog.size()), prog.data(),
               static_cast<int>(what.size()), what.data());
  return code;
}

}  // namespace

int print_status(const StatusQuery& q, std::string_view prog) {
  auto hp = parse_host_port(q.endpoint);
  if (!hp.ok()) return error(prog, hp.status().message(), 2);
  const auto start = std::chrono::steady_clock::now();
  // Through the system resolver and bounded, as launch reaches its server; gRPC gets an address.
  auto addresses = rendezvous::resolve_host(hp->host, q.timeout);
  if (!addresses.ok()) {
    return error(prog, absl::StrCat("cannot reach the rendezvous server at ", q.endpoint, ": ",
                                    addresses.status().message()),
                 1);
  }
  const auto left = std::max(std::chrono::milliseconds(1),
                             q.timeout - std::chrono::duration_cast<std::chrono::milliseconds>(
                                             std::chrono::steady_clock::now() - start));
  rendezvous::ClientTlsFiles files = q.tls;
  if (files.server_name.empty()) files.server_name = hp->host;
  absl::StatusOr<rendezvous::ClientTls> tls = rendezvous::ClientTls{};
  if (!files.ca.empty() || !files.cert.empty() || !files.key.empty()) {
    tls = rendezvous::load_client_tls(files);
    if (!tls.ok()) return error(prog, tls.status().message(), 2);
  }
  auto reply = rendezvous::get_status(rendezvous::grpc_address_target(addresses->front(), hp->port),
                                      q.run_id, q.token, left, *tls);
  if (!reply.ok()) {
    const absl::Status& st = reply.status();
    if (absl::IsPermissionDenied(st) || absl::IsUnauthenticated(st)) {
      return error(prog, absl::StrCat("the rendezvous server at ", q.endpoint,
                                      " refused the status call: ", st.message()),
                   1);
    }
    if (absl::IsDeadlineExceeded(st)) {
      return error(prog, absl::StrCat("the rendezvous server at ", q.endpoint,
                                      " did not answer within ", q.timeout.count() / 1000.0, " s"),
                   1);
    }
    return error(prog, absl::StrCat("cannot reach the rendezvous server at ", q.endpoint, ": ",
                                    st.message()),
                 1);
  }
  if (!q.run_id.empty() && reply->runs().empty()) {
    return error(prog, absl::StrCat("the rendezvous server at ", q.endpoint, " holds no run '",
                                    q.run_id, "'"),
                 1);
  }
  const std::string text = q.json ? status_json(*reply) + "\n" : status_table(*reply);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
  return 0;
}

void add_status_tls_options(CLI::App& app, StatusQuery& q) {
  app.add_option("--tls_ca,--tls-ca", q.tls.ca, "PEM CA of a TLS server (or $MUSTER_TLS_CA)")
      ->envname(rendezvous::kTlsCaVar);
  app.add_option("--tls_cert,--tls-cert", q.tls.cert,
                 "PEM client certificate, for mutual TLS (or $MUSTER_TLS_CERT)")
      ->envname(rendezvous::kTlsCertVar);
  app.add_option("--tls_key,--tls-key", q.tls.key, "Its private key (or $MUSTER_TLS_KEY)")
      ->envname(rendezvous::kTlsKeyVar);
  app.add_option("--tls_server_name,--tls-server-name", q.tls.server_name,
                 "The name the server's certificate must carry (default: the endpoint's host)")
      ->envname(rendezvous::kTlsServerNameVar);
}

}  // namespace muster::status
