// The /proc parsers and the decision about workers that do not die (agent/proc_state.h), over
// recorded /proc text.
#include "muster/agent/proc_state.h"

#include <unistd.h>

#include <catch2/catch.hpp>

using muster::agent::parse_proc_state;
using muster::agent::ProcState;
using muster::agent::read_proc_state;
using muster::agent::stuck_worker_message;
using muster::agent::workers_to_abandon;

namespace {

// Recorded from a process frozen by the cgroup v1 freezer (kernel 6.18), its comm changed.
constexpr const char* kStatD =
    "812 (my (odd) prog) D 12791 12791 11853 0 -1 4194368 104 119 0 0 0 0 0 0 20 0 1 0 "
    "5822861 9187328 917 18446744073709551615 1 1 0 0 0 0 65536 4 65538 0 0 0 17 1 0 0 0 0 0";
constexpr const char* kStackD =
    "thread 812 (my (odd) prog) state: D (disk sleep) wchan: __refrigerator\n"
    "[<0>] __refrigerator+0xac/0xd0\n"
    "[<0>] get_signal+0x604/0x8a0\n"
    "[<0>] arch_do_signal_or_restart+0x71/0x2a0\n"
    "[<0>] exit_to_user_mode_loop+0x6b/0xe0\n"
    "\n";

}  // namespace

TEST_CASE("proc_state: state D, a name with spaces and parentheses, its wchan", "[proc_state]") {
  auto s = parse_proc_state(kStatD, "__refrigerator");
  REQUIRE(s);
  CHECK(s->state == 'D');
  CHECK(s->wchan == "__refrigerator");
}

TEST_CASE("proc_state: a name that ends in ') R' does not fool it (the last ')')",
          "[proc_state]") {
  auto s = parse_proc_state("77 (x) R (y) S 1 77 77 0 -1 4194560", "do_sys_poll\n");
  REQUIRE(s);
  CHECK(s->state == 'S');
  CHECK(s->wchan == "do_sys_poll");  // the trailing newline trimmed
}

TEST_CASE("proc_state: S, Z, R, wchan 0 or empty is none", "[proc_state]") {
  auto sleeping = parse_proc_state("4242 (train) S 1 4242 4242 0 -1 4194560 9 0", "hrtimer_nanosleep");
  REQUIRE(sleeping);
  CHECK(sleeping->state == 'S');
  CHECK(sleeping->wchan == "hrtimer_nanosleep");
  auto zombie = parse_proc_state("4243 (train) Z 1 4243 4243 0 -1 4227084 0 0", "0");
  REQUIRE(zombie);
  CHECK(zombie->state == 'Z');
  CHECK(zombie->wchan.empty());
  auto running = parse_proc_state("4244 (train) R 1 4244 4244 0 -1 4194304\n", "");
  REQUIRE(running);
  CHECK(running->state == 'R');
  CHECK(running->wchan.empty());
}

TEST_CASE("proc_state: malformed stat text is refused", "[proc_state]") {
  CHECK_FALSE(parse_proc_state("", ""));
  CHECK_FALSE(parse_proc_state("812", ""));
  CHECK_FALSE(parse_proc_state("812 (prog", ""));             // no ')'
  CHECK_FALSE(parse_proc_state("812 (prog)", ""));            // nothing after it
  CHECK_FALSE(parse_proc_state("812 (prog) ", ""));           // no state
  CHECK_FALSE(parse_proc_state("812 (prog)D 1", ""));         // no space before the state
  CHECK_FALSE(parse_proc_state("812 (prog) DD 1", ""));       // a state is one letter
  CHECK_FALSE(parse_proc_state("812 (prog) 5 1", ""));        // not a letter
  CHECK_FALSE(parse_proc_state("pid (prog) S 1", ""));        // not a pid
  CHECK_FALSE(parse_proc_state("(prog) S 1", ""));            // no pid
  CHECK_FALSE(parse_proc_state("812 prog) S 1", ""));         // no '('
}

TEST_CASE("proc_state: reads this process from /proc (running)", "[proc_state]") {
  auto s = read_proc_state(::getpid());
  REQUIRE(s);
  CHECK(s->state == 'R');
  CHECK_FALSE(read_proc_state(-5));
}

TEST_CASE("proc_state: only workers in state D are left behind", "[proc_state]") {
  std::vector<std::optional<ProcState>> states = {
      ProcState{'D', "fuse_wait_answer"},  // stuck in the kernel
      ProcState{'Z', ""},                  // dead, about to be reaped
      std::nullopt,                        // gone (or unreadable)
      ProcState{'R', ""},                  // about to die
      ProcState{'D', "__refrigerator"},
      ProcState{'S', "do_wait"},
  };
  CHECK(workers_to_abandon(states) == std::vector<std::size_t>{0, 4});
  CHECK(workers_to_abandon({}).empty());
  CHECK(workers_to_abandon({ProcState{'Z', ""}, ProcState{'T', ""}}).empty());
}

TEST_CASE("proc_state: the warning names rank, pid, state, wchan and the stack's first lines",
          "[proc_state]") {
  const std::string m = stuck_worker_message(3, 812, ProcState{'D', "__refrigerator"}, kStackD, 3);
  CHECK(m ==
        "worker rank 3 (pid 812) is stuck in the kernel (state D, wchan __refrigerator): it does "
        "not die on SIGKILL; going on without it\n"
        "  thread 812 (my (odd) prog) state: D (disk sleep) wchan: __refrigerator\n"
        "  [<0>] __refrigerator+0xac/0xd0\n"
        "  [<0>] get_signal+0x604/0x8a0");
  const std::string no_wchan = stuck_worker_message(0, 9, ProcState{'D', ""}, "", 8);
  CHECK(no_wchan ==
        "worker rank 0 (pid 9) is stuck in the kernel (state D): it does not die on SIGKILL; going "
        "on without it");
}
