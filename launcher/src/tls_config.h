// launch's TLS settings (docs/operations.md, "TLS"): checked and read after parsing
// (config.cc), before the rendezvous is resolved.
#pragma once

#include <map>
#include <string>

#include "absl/status/status.h"
#include "muster/launcher/config.h"

namespace muster::launcher {

// Fills each client TLS setting --rdzv_conf left out from `env` (MUSTER_TLS_*), reads the
// server's files (--tls_cert, --tls_key, --tls_ca) and, unless `cluster` (the files are then
// the hosts' own), the client's. A server with TLS needs agents that verify it, this
// launch's own among them: --tls_cert without tls_ca, or --tls_ca (client certificates)
// without tls_cert, is a usage error. With --hosts and --rdzv_endpoint the driver hosts
// nothing, so the server flags are refused there.
absl::Status resolve_tls(LaunchConfig& c, const std::map<std::string, std::string>& env,
                         bool cluster);

}  // namespace muster::launcher
