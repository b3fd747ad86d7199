// The per-node elastic agent: joins a round through the rendezvous server, spawns this
// node's workers, watches them, and restarts, fails or finishes as the server says.
//
// Threads: everything runs on the io_context given to the constructor, which run() drives
// on the calling thread. That must be the main thread: workers' PR_SET_PDEATHSIG follows
// the thread that forked them. Child exits (pidfd), output pipes, signals (delivered by
// main through on_signal) and rendezvous messages are all events on that loop; nothing polls.
#pragma once

#include <boost/asio/io_context.hpp>
#include <memory>

#include "muster/agent/agent_options.h"
#include "muster/agent/session_machine.h"

namespace muster::agent {

class Agent {
 public:
  Agent(boost::asio::io_context& io, AgentOptions options);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Runs the job to its end and returns launch's exit code: 0 when every worker succeeded,
  // 1 on worker failure with no restarts left or a rendezvous error, 128+N when stopped by
  // signal N. Blocks; drives the io_context.
  int run();

  // A signal launch received (main owns the signal_set, so that signals stay handled from
  // startup to exit): forwarded to every worker's process group, the node leaves the run,
  // and run() returns 128+N once the workers are gone; a second signal skips the grace.
  // Called on the io_context's thread; ignored once the job has ended.
  void on_signal(int sig);

  // After run(): the job failed and run() printed torchrun's failure summary (exit 1).
  bool failed() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace muster::agent
