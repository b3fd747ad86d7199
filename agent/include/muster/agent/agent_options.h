// What an agent is told: its rendezvous server and run, its node, its workers and where
// their output goes. Filled by launch's main from the flags (launcher/config.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/local_session.h"
#include "muster/agent/agent_events.h"
#include "muster/agent/endpoints.h"
#include "muster/agent/numa.h"
#include "muster/agent/supervisor.h"
#include "muster/rendezvous/timeouts.h"
#include "muster/rendezvous/tls.h"

namespace muster::agent {

struct AgentOptions {
  // Rendezvous
  std::string rdzv_target;  // the rendezvous server's gRPC target (an address: ipv4:A:P, ...)
  std::string rdzv_name;    // the server as messages name it (the endpoint as given)
  // The server is in this process (launch's embedded one): sessions to rdzv_target go to it
  // without a socket (muster/rendezvous/local_session.h). Null: over gRPC.
  std::shared_ptr<rendezvous::LocalServer> local_rdzv;
  // More endpoints after that one (--rdzv_endpoint=a,b,c): a connection attempt that fails
  // moves on to the next, round the list (endpoints.h).
  std::vector<RdzvEndpoint> rdzv_more;
  bool wait_for_server = false;
  // How long to wait for the server: at the start (when wait_for_server), and after the node
  // lost it (it stops its workers, then reconnects and joins its run again for this long).
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(60)};
  std::string token;
  // TLS to the server (its files also go to the workers, MUSTER_TLS_*); not enabled: plaintext.
  rendezvous::ClientTls tls;
  std::string run_id;
  std::string node_id;
  std::string host;  // this node's address for MASTER_ADDR and the summary
  // Workers read /dev/null instead of launch's stdin (an agent started by launch --hosts,
  // whose stdin is the ssh channel it watches).
  bool workers_stdin_null = false;
  // --hang_timeout (docs/hangs.md): 0 is off. Each worker gets a progress page
  // (MUSTER_PROGRESS_FILE); a rank whose progress stays still this long while another rank
  // got further is dumped (stacks.txt beside its logs) and fails the group.
  std::chrono::milliseconds hang_timeout{0};
  // --watch_stragglers (docs/stragglers.md): sent in the Join; the server scores the ranks.
  bool watch_stragglers = false;
  // --exclude_stragglers, --straggler_cooldown (docs/stragglers.md, "Exclusion"): sent in the
  // Join; the server may take a straggler's node out of the world for the cool-down.
  bool exclude_stragglers = false;
  std::chrono::milliseconds straggler_cooldown{0};
  // --preflight (docs/stragglers.md, "Pre-flight"): before the first round's workers start,
  // every node's compute and links are measured; a node far slower leaves the run.
  bool preflight = false;
  // gdb for a stalled native worker's stacks (found on PATH once, by the caller); empty: the
  // kernel's view only (/proc/PID/task/*/stack).
  std::string gdb_path;
  // A budget that knows progress (docs/hangs.md; 0: off): sent in the Join, applied by the
  // server from the progress reports.
  int max_restarts_without_progress = 0;
  std::int64_t restart_budget_reset_after_steps = 0;
  int min_nodes = 1;
  int max_nodes = 1;
  int requested_rank = -1;
  int max_restarts = 0;
  // MUSTER_STORE_ADDR as workers should reach it. When it is rdzv_target and the agent is on
  // another of its endpoints when a round forms, that endpoint's target.
  std::string store_addr;
  // The run's timing rules, sent with every Join (the first node's hold for the run); the
  // agent sends kKeepAlivesPerInterval keep-alives per keep_alive_interval (session_machine.h;
  // fewer in a round of more than 1,000 nodes at the default: keep_alives_per_interval), and
  // knows it is out of the run when it has heard nothing from the server (which answers each)
  // for the liveness window, keep_alive_interval x keep_alive_max_attempt.
  rendezvous::RendezvousTimeouts rdzv_timeouts;
  // Static rendezvous: the workers' MASTER_ADDR/MASTER_PORT are fixed by flags. When empty,
  // they come from the round (a free port on the group-rank-0 node).
  std::string master_addr;
  int master_port = 0;
  // When the server keeps the run's TCPStore-protocol tables (Assignment.store_relay) and no
  // static master is set: the agent serves the round's store on loopback (store_relay.h),
  // MASTER_ADDR=127.0.0.1, MASTER_PORT its listener, TORCHELASTIC_USE_AGENT_STORE=True (as
  // torchrun 2.x). False: rank-0 hosting (a free port on the group-rank-0 node,
  // TORCHELASTIC_USE_AGENT_STORE=False).
  bool use_agent_store = true;
  // That store's agent answers reads of keys its node set (StoreRelayOptions::cache).
  bool store_cache = true;

  // Workers
  int nproc_per_node = 1;
  std::string role = "default";
  std::string program_path;       // resolved executable
  std::vector<std::string> argv;  // argv[0] included
  std::string entrypoint_name;    // what the failure summary calls the job
  // A Python program: its interpreter and why it was chosen ("/usr/bin/python3 (python3 from
  // PATH)"). When a worker of this node failed with ModuleNotFoundError (its error file or the
  // end of its stderr says so), the failure summary is followed by a hint naming it and
  // PYTHON_EXEC. Empty: not Python, no hint.
  std::string python_interpreter;
  // Put first on a Python worker's PYTHONPATH when the run has a hang timeout: launch's hook
  // that counts an unmodified PyTorch script's steps (docs/hangs.md). Empty: none.
  std::string python_progress_hook;
  // muster's Python helpers (launcher/python.h muster_python_dir): with --in_place, appended to
  // a Python worker's PYTHONPATH so that it can `import muster_inplace` (docs/in_place_torch.md).
  std::string python_dir;
  std::map<std::string, std::string> base_env;
  std::string prefix_template;  // TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, or the default
  std::string error_dir;  // attempt_<k>/<local_rank>/ folders go under here
  // Per local rank, bit 1 stdout and bit 2 stderr: to the log files only (redirect), or to
  // the files and the console (tee). Empty: neither. Files hold the raw output, unprefixed.
  std::vector<int> redirect_of, tee_of;
  std::vector<bool> console_of;  // empty: every rank reaches the console
  // torchrun 2.x's --duplicate_{stdout,stderr}_filters: each console line of that stream whose
  // text (without the prefix) contains any of these is also written, prefixed as on the
  // console, to attempt_<k>/filtered_stdout.log (filtered_stderr.log), one file per attempt
  // shared by the node's workers. Empty: no file.
  std::vector<std::string> duplicate_stdout_filters, duplicate_stderr_filters;
  std::string own_error_file;    // launch's own TORCHELASTIC_ERROR_FILE, written on failure
  // torchrun's file-timer watchdog: the FIFO the agent serves (agent/file_timer.h); empty: off.
  std::string file_timer_path;
  std::chrono::milliseconds shutdown_timeout{std::chrono::seconds(30)};
  // --in_place (docs/in_place.md): each worker gets a control channel; a failure keeps the
  // workers that declared in-place support running, and they re-form in the next round.
  // in_place_timeout: how long the re-formed round may take to report resumed.
  bool in_place = false;
  std::chrono::milliseconds in_place_timeout = rendezvous::limits::kDefaultInPlaceTimeout;
  // --spares: warm spare processes kept on this node once a worker declared that the program
  // can wait as one (`hello spare=1`, muster_inplace.await_rank); a dead worker's place is
  // taken by one (`take`) instead of a new process (worker_group.h).
  int spares = rendezvous::limits::kDefaultSpares;
  std::string signals_to_handle = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";  // as given, for the workers
  bool virtual_local_rank = false;  // LOCAL_RANK=0, one device each (worker_env.h)
  // --numa-binding: each local rank's CPUs and memory node (agent/numa.h); empty: none.
  std::vector<NumaBinding> numa_of;
  // What keeps the job's descendants from outliving it (owned by main; may be null): each
  // worker joins its cgroup and its process group is tracked.
  JobSupervisor* supervisor = nullptr;
  // Output sinks (the console).
  int stdout_fd = 1;
  int stderr_fd = 2;
  // Called on the io thread with every event of this node (agent_events.h), in order: the
  // event log, metrics.
  std::vector<std::function<void(const AgentEvent&)>> event_sinks;
};

}  // namespace muster::agent
