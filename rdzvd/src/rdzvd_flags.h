// rdzvd's flags (docs/operations.md): their values as given, and what they become.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "muster/ops/endpoint.h"
#include "muster/rendezvous/etcd.h"
#include "muster/rendezvous/timeouts.h"
#include "muster/rendezvous/tls.h"

namespace muster::rdzvd {

struct Flags {
  std::string listen = absl::StrCat("0.0.0.0:", ops::kDefaultRendezvousPort);
  std::string token, token_file;
  rendezvous::ServerTlsFiles tls_files;
  // Seconds, as given.
  double join_timeout = 600, last_call = 30, grace = 60, hang = 0, reattach = 0, lease_ttl = 0;
  int metrics_port = -1;  // off
  int http_port = -1;     // off
  std::string state_dir;
  bool state_fsync = false;
  std::string etcd_endpoints, etcd_prefix, advertise;
  std::string event_log_path;
};

// Adds every flag of the daemon to `app`, bound to `flags` (which starts with the defaults).
void add_flags(CLI::App& app, Flags& flags);

// What CLI11 cannot check alone: flags that exclude or need each other (InvalidArgument).
absl::Status check(const Flags& flags);

rendezvous::RendezvousTimeouts timeouts_of(const Flags& flags);
rendezvous::EtcdOptions etcd_options_of(const Flags& flags);

}  // namespace muster::rdzvd
