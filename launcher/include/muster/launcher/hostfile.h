// The hosts of a whole-cluster launch (--hosts, --hostfile, --include, --exclude; issue 15).
//
// Pure functions: no file, no resolver, no clock. The ssh driver reads the hostfile and passes
// its text here; every host that comes back is safe to place on an ssh command line as one
// argument (the checks below), and is at most limits::kMaxIdBytes long.
//
// A host is
//   - a name or IPv4 address: [A-Za-z0-9._-]+, not starting with '-' (ssh would take it for
//     an option);
//   - an IPv6 address: in brackets where slots follow ("[fd00::1]:4"), bare where they do not
//     ("fd00::1"; a bare item with two or more ':' is always the address, never address:slots);
//     an optional zone ("fe80::1%eth0"). `host` holds it without brackets, as ssh takes it;
//   - either of these after "user@" (ssh's own syntax); `host` keeps the "user@".
// Anything else (whitespace, ;|&$`'"\<> and the like) is refused: a host name goes into an ssh
// command line. Two entries naming the same host are refused ("host X is listed twice"); the
// same host is the same name ignoring case and user@, or the same IPv6 address however spelt.
// slots, where given, is an integer in 1..rendezvous::kMaxLocalWorldSize; at most
// rendezvous::limits::kMaxHosts hosts; an empty list is an error. Order is kept.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace muster::launcher {

struct HostSlots {
  std::string host;
  int slots = 0;  // 0: not given (launch's --nproc_per_node applies)
};

// --hosts: horovod's -H syntax, "h1:8,h2:8,h3", "[fd00::1]:4,fd00::2". Whitespace around items
// is trimmed; an empty item ("h1,,h2", a trailing ',') is an error. Errors start "--hosts: ".
absl::StatusOr<std::vector<HostSlots>> parse_host_list(std::string_view text);

// --hostfile contents. Per line one host, in any of
//   DeepSpeed's / OpenMPI's   host slots=N [max_slots=M]   (max_slots is checked, then ignored)
//   horovod's                 host:N
//   bare                      host
// '#' starts a comment (a whole line or the rest of one); blank lines are skipped. Errors name
// `source` and the 1-based line number: "hosts.txt:3: slots=0 is not in 1..65536".
absl::StatusOr<std::vector<HostSlots>> parse_hostfile(std::string_view text,
                                                      std::string_view source);

// --include / --exclude (DeepSpeed's): host names separated by ',' or '@' ("a,b", "a@b"); an
// item that names a listed "user@host" whole is that host. Names match as duplicates do
// (ignoring case and the user@ of a listed host). At most one of the two may be non-empty
// (after trimming); neither: `hosts` unchanged. Errors: a name not in `hosts`; DeepSpeed's
// per-GPU "host:0,1" (not supported: select GPUs with CUDA_VISIBLE_DEVICES); a selection that
// leaves no host. The order of `hosts` is kept.
absl::StatusOr<std::vector<HostSlots>> select_hosts(std::vector<HostSlots> hosts,
                                                    std::string_view include,
                                                    std::string_view exclude);

}  // namespace muster::launcher
