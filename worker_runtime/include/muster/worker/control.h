// In-place recovery, the worker's side (docs/in_place.md): the control channel from the agent.
//
// Under `launch --in_place` every worker gets MUSTER_CONTROL_FD, its end of a socket pair
// with its agent (ops/control_channel.h has the wire). The contract, for a program that opts
// in with Runtime::enable_in_place():
//
//  1. `hello` (enable_in_place) declares that this process re-forms in place. A worker that
//     never says it gets today's full restart: the agent stops every worker of its node on
//     any failure, as without --in_place.
//  2. `abort`: the agent learnt that the world is over (a rank or node was lost). A thread
//     of the runtime, blocked in recv() until then (no polling), aborts every communicator the
//     Runtime made: a collective blocked on a dead peer returns CANCELLED at once, and so
//     does every later call on them.
//  3. `world`: the next round's ranks. Runtime::await_world() returns it (the latest, when
//     several came), moves the store to the round's prefix, and communicator() then builds
//     the new ring. A world message aborts too (an abort may be lost with a failure of its own).
//  4. `resumed`: Runtime::resumed() after the first step completed in the new world. The
//     agent waits for every one of its workers to say it within --in_place_timeout; one
//     that does not, or says it for another round, makes the node fall back to the full
//     restart.
//
// The agent closing the channel (it exited) makes await_world() fail at once.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "muster/worker/comm/communicator.h"

namespace muster::worker {

// One `world` message: the round this worker is in from now on.
struct World {
  int round = 0;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int group_rank = 0;
  int group_world_size = 1;
  int restart_count = 0;
  std::string master_addr;
  int master_port = 0;
  std::vector<int> lost;  // global ranks of the round before whose nodes left (may be empty)
  // The channel's epoch (ControlChannel::epoch) once this message had come: a later abort or
  // world makes epoch() differ, so what is built for this world is already stale.
  std::uint64_t epoch = 0;
};

// Parses a `world` message's fields; INVALID_ARGUMENT naming the bad one.
absl::StatusOr<World> parse_world(const std::string& packet);

class ControlChannel {
 public:
  // Takes `fd` (a SOCK_SEQPACKET socket) and starts the reader thread.
  explicit ControlChannel(int fd);
  ~ControlChannel();  // shuts the socket down, which ends the reader thread
  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;

  absl::Status send_hello();
  absl::Status send_resumed(int round);

  // Communicators that an abort or world message aborts, until forgotten.
  void watch(Communicator* c);
  void forget(Communicator* c);

  // How many abort or world messages have come: a communicator being built (set-up is not a
  // call abort() reaches) checks it did not change meanwhile.
  std::uint64_t epoch() const;
  // The next world not yet taken, waiting at most `timeout` for it; the latest when several
  // came, with the epoch it came with (an abort that came after it is not its own). UNAVAILABLE when the agent closed the channel, DEADLINE_EXCEEDED after the timeout.
  absl::StatusOr<World> await_world(std::chrono::milliseconds timeout);

 private:
  void read_loop();
  absl::Status send(const std::string& packet);

  const int fd_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::set<Communicator*> watched_;
  std::optional<World> pending_;  // its epoch set
  std::uint64_t epoch_ = 0;
  bool closed_ = false;
  std::thread reader_;
};

}  // namespace muster::worker
