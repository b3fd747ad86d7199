// launch on one node: host or reach the rendezvous server, make the log folder, run this
// node's agent to the end of the job, close a hosted server, and exit (docs/launch.md).
#pragma once

#include <boost/asio/io_context.hpp>
#include <functional>

#include "muster/agent/supervisor.h"
#include "muster/launcher/config.h"

namespace muster::launcher {

// Never returns: launch leaves with _exit(code), with its signal set still standing (see
// node_job.cc). `on_signal` is main's handler for the signals launch handles; the job sets it.
[[noreturn]] void run_node_job(const LaunchConfig& cfg, boost::asio::io_context& io,
                               std::function<void(int)>& on_signal,
                               muster::agent::JobSupervisor* supervisor);

}  // namespace muster::launcher
