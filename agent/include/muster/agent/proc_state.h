// A process's scheduler state as /proc shows it, and what the agent does with a worker that
// does not die.
//
// A worker in uninterruptible sleep (state D: a hung FUSE or NFS request, a frozen cgroup, a
// driver waiting on a device) does not die on SIGKILL until the kernel lets go of it, which
// may be never. After a stop has sent SIGKILL and waited limits::kUnkillableWait, the agent
// reads the state of each worker not yet reaped; one in state D is left behind (the group goes
// on without it, and the job's end names its pid), any other state keeps being waited for
// (a zombie is about to be reaped; a running one is about to die).
//
// The parsers are pure (tests feed them recorded /proc text); read_proc_state reads /proc.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace muster::agent {

struct ProcState {
  char state = '?';   // R, S, D, Z, T, t, X, I, ...
  std::string wchan;  // the kernel function it waits in; empty when running or unknown
};

// The state from /proc/PID/stat's text and the wait channel from /proc/PID/wchan's ("0" or
// empty: none). The command name in stat is in parentheses and may itself hold spaces and
// parentheses, so the state is the field after the LAST ')'. nullopt: not a stat line.
std::optional<ProcState> parse_proc_state(std::string_view stat, std::string_view wchan);

// A small /proc file (at most a few KiB), whole; nullopt when it cannot be opened.
std::optional<std::string> read_proc_file(const std::string& path);

// /proc/PID/stat and /proc/PID/wchan of `pid`; nullopt when it cannot be read (gone).
std::optional<ProcState> read_proc_state(pid_t pid);

// The decision, after the wait that followed SIGKILL: of the workers still not reaped (their
// states in order, nullopt where it could not be read), the indices of those to leave behind:
// those in state D. Others (a zombie, a running process, an unreadable state) are waited for.
std::vector<std::size_t> workers_to_abandon(const std::vector<std::optional<ProcState>>& states);

// The warning for a worker left behind: "worker rank 3 (pid 812) is stuck in the kernel
// (state D, wchan fuse_wait_answer): it does not die on SIGKILL; going on without it", then
// up to `max_stack_lines` lines of `kernel_stack` (kernel_stacks' text), indented.
std::string stuck_worker_message(int rank, pid_t pid, const ProcState& state,
                                 std::string_view kernel_stack, int max_stack_lines);

}  // namespace muster::agent
