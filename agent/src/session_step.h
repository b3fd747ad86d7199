// SessionMachine's private pieces, shared by its files (session_machine.cc, the rules;
// session_probe.cc, the probe): one event's actions being collected, and the helpers both use.
#pragma once

#include <chrono>
#include <string>
#include <utility>

#include "muster/agent/session_machine.h"

namespace muster::agent::session {

inline double seconds(std::chrono::milliseconds d) {
  return static_cast<double>(d.count()) / 1000;
}
inline double seconds(Clock::duration d) {
  return seconds(std::chrono::duration_cast<std::chrono::milliseconds>(d));
}

// One event's actions, in the order they are to be carried out.
class SessionMachine::Step {
 public:
  explicit Step(Time now) : now(now) {}
  template <class A>
  void add(A a) {
    out.emplace_back(std::move(a));
  }
  void log(Level level, std::string text) { add(Log{level, std::move(text)}); }

  const Time now;
  Actions out;
};

}  // namespace muster::agent::session
