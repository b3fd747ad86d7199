// launch --hosts / --hostfile: runs the job on every host from this command (cluster.h).
#pragma once

#include <boost/asio/io_context.hpp>
#include <functional>

#include "muster/agent/supervisor.h"
#include "muster/launcher/config.h"

namespace muster::launcher {

// Hosts the rendezvous (unless --rdzv_endpoint names one), starts one agent per host, copies
// every host's output here as whole lines prefixed with the host, and returns the job's exit
// code once every agent has ended. `on_signal` is main's handler for the signals launch
// handles: the driver sets it to stop every host. What it starts is in `supervisor`'s job
// (nullptr: none), so that a driver killed with -9 leaves no ssh session behind either.
int run_cluster(const LaunchConfig& cfg, boost::asio::io_context& io,
                std::function<void(int)>& on_signal, muster::agent::JobSupervisor* supervisor);

}  // namespace muster::launcher
