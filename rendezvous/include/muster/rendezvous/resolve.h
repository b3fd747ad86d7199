// Name lookups through the system resolver (getaddrinfo: /etc/hosts, then whatever
// nsswitch.conf names), each bounded by a timeout.
//
// gRPC's own resolver (c-ares) reads /etc/hosts but then asks DNS for the other address
// family, so one name behind a resolver that does not answer cost a job over a minute.
// launch looks every name up here once (the rendezvous endpoint, this host's FQDN, the
// is_host check) and gives gRPC an address, never a name.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "muster/rendezvous/limits.h"

namespace muster::rendezvous {

// The addresses `host` has, numeric ("10.0.0.1", "fd00::1"), in the system's order of
// preference (glibc's RFC 6724 sort); an IP literal is itself, without a lookup. Errors:
// NOT_FOUND (no such name), DEADLINE_EXCEEDED (the resolver did not answer in time), each
// naming the host. A lookup that times out is left to finish on its own thread.
absl::StatusOr<std::vector<std::string>> resolve_host(
    const std::string& host, std::chrono::milliseconds timeout = limits::kResolveTimeout);

// Whether `host` is an IPv4 or IPv6 address (no brackets), not a name.
bool is_ip_literal(const std::string& host);

// The host of "HOST:PORT" or "[V6]:PORT" ("node0", "fd00::1"), without brackets; a string
// with no port is all host.
std::string host_of(const std::string& host_port);

// A gRPC target for one numeric address: "ipv4:10.0.0.1:29400" or "ipv6:[fd00::1]:29400".
std::string grpc_address_target(const std::string& address, int port);

// This host's canonical name, as Python's socket.getfqdn() finds it (torchrun's
// MASTER_ADDR): the name of the first address of gethostname(), else the canonical name,
// else gethostname() itself, which is also what a lookup past `timeout` gives.
std::string fully_qualified_hostname(std::chrono::milliseconds timeout = limits::kResolveTimeout);

// Whether one of `addresses` (numeric) belongs to an interface of this host.
bool is_local_address(const std::vector<std::string>& addresses);

}  // namespace muster::rendezvous
