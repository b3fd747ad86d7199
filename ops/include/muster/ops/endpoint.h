// HOST:PORT, the one parser: launch's --rdzv_endpoint, `launch status` / `rdzvd status`
// --endpoint, and the default port they share.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace muster::ops {

// torchrun's default rendezvous port (c10d): rdzvd's, launch's, `status`'s and the first
// port the scheduler integrations derive (launcher/scheduler_env.h).
inline constexpr int kDefaultRendezvousPort = 29400;

struct HostPort {
  std::string host;  // without brackets
  int port = 0;
  std::string to_string() const;  // brackets back around an IPv6 host
};

// HOST:PORT, [V6]:PORT, HOST or [V6] (the port is then `default_port`). A port must be a
// number from `min_port` to 65535. An error's message says what is wrong ("has no host",
// "has a bad port", ...), for the caller to put in context.
absl::StatusOr<HostPort> parse_host_port(std::string_view text, int default_port, int min_port);

}  // namespace muster::ops
