// Every bound the rendezvous server and its clients enforce, in one place.
//
// Each is enforced at the edge (where a message, a request or a flag first arrives) and
// written in docs/rendezvous.md ("Bounds"). Defaults that a caller may change are fields of
// an options struct (StoreLimits, RendezvousTimeouts, ServerOptions) whose initialisers
// name the constants below; nothing else repeats a number.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "muster/ops/progress_page.h"

namespace muster::rendezvous::limits {

using std::chrono::milliseconds;

// --- Rendezvous messages (Session stream) ---------------------------------------------
// One AgentMsg (a Join, a failure report, a keep-alive). Larger messages end the stream with
// RESOURCE_EXHAUSTED. A ServerMsg carries at most a Fail with a capped root cause and
// kMaxFailureOthers capped failures, so it stays below kMaxServerMessageBytes.
inline constexpr std::size_t kMaxAgentMessageBytes = 64 << 10;
inline constexpr std::size_t kMaxServerMessageBytes = 1 << 20;
// Run ids, node ids, hosts, tokens.
inline constexpr std::size_t kMaxIdBytes = 256;
// What one WorkerFailure may carry: message and traceback are cut to these (with a note).
inline constexpr std::size_t kMaxFailureMessageBytes = 8 << 10;
inline constexpr std::size_t kMaxFailureTracebackBytes = 16 << 10;
inline constexpr std::size_t kMaxFailureOthers = 16;

// --- Durations a client may set (Join, rdzv_conf) --------------------------------------
// Larger values are refused by `launch` (usage error) and clamped by the server.
inline constexpr milliseconds kMaxJoinTimeout = std::chrono::hours(24);
inline constexpr milliseconds kMaxLastCallTimeout = std::chrono::hours(1);
inline constexpr milliseconds kMaxKeepAliveInterval = std::chrono::minutes(10);
inline constexpr int kMaxKeepAliveAttempts = 100;
// The liveness rule (docs/rendezvous.md, "Liveness"): a node silent for keep_alive_interval
// x keep_alive_max_attempt (the liveness window) is dropped by the server, and an agent that
// hears nothing from its server for as long knows it is out of the run. The default window
// is 2 s. A Join whose window would exceed kMaxLivenessWindow has its attempts lowered to
// fit (launch refuses such a --rdzv_conf).
inline constexpr milliseconds kDefaultKeepAliveInterval = std::chrono::milliseconds(500);
inline constexpr int kDefaultKeepAliveAttempts = 4;
inline constexpr milliseconds kMaxLivenessWindow = std::chrono::hours(1);
// The server's transport keep-alive reclaims connections that stayed silent for longer than
// any run's window may be (the state machine has dropped their nodes long before): a ping
// after kMaxLivenessWindow of silence, the connection closed when it is not answered within
// kTransportKeepAliveTimeout. It never decides before a run's own rule.
inline constexpr milliseconds kTransportKeepAliveTimeout = std::chrono::seconds(20);
// An agent's connection attempt to its server is given one liveness window, at least this.
inline constexpr milliseconds kMinConnectAttempt = std::chrono::seconds(1);
// When an agent gives up waiting for its server, one call that does not wait (bounded by
// this) asks gRPC why it could not connect (refused, a failed TLS handshake), for the error.
inline constexpr milliseconds kConnectErrorProbe = std::chrono::milliseconds(500);
inline constexpr milliseconds kMaxShutdownTimeout = std::chrono::hours(1);
// A Join's shutdown_timeout_ms of 0 (or less) stands for this: the agent's own default
// --shutdown_timeout, so the server waits as long as such an agent may take to stop.
inline constexpr milliseconds kDefaultShutdownTimeout = std::chrono::seconds(30);
// After a restart, a survivor of the previous round holds the next round for its own
// shutdown timeout plus this margin (for the Join to travel and the agent to react); a
// survivor not back by then no longer holds it.
inline constexpr milliseconds kRejoinMargin = std::chrono::seconds(5);
inline constexpr milliseconds kMaxCloseTimeout = std::chrono::hours(1);
inline constexpr milliseconds kMaxReadTimeout = std::chrono::hours(24);
// rdzvd --finished_run_grace (an operator's flag, bounded all the same).
inline constexpr milliseconds kMaxFinishedRunGrace = std::chrono::hours(24);
// Store waits (get, wait, multi_get): a longer timeout is clamped to this.
inline constexpr milliseconds kMaxStoreWait = std::chrono::hours(24);

// --- Restarting the server without restarting workers (rdzvd --state_dir) ----------------
// How long a restarted server holds the places of a running run's members for them to
// re-attach (from the restore), and how long an agent whose stream ended keeps its workers
// running while it reconnects (from the loss): the run's rdzv_conf reattach_timeout (the
// first node's), else rdzvd --reattach_timeout, else this. The agent counts from the loss
// and the server from its restore, which comes later: the server's hold outlasts the
// agent's attempts with the same value.
// In-place recovery (launch --in_place_timeout, docs/in_place.md): how long a node waits
// for every worker of the re-formed round to report it resumed before it falls back to the
// full restart.
inline constexpr milliseconds kDefaultInPlaceTimeout = std::chrono::seconds(30);
inline constexpr milliseconds kMaxInPlaceTimeout = std::chrono::minutes(10);
// Warm spares (launch --spares, docs/in_place_torch.md "Warm spares"): processes per node
// that have started the program up to its muster_inplace.await_rank() and take a dead
// rank's place at once. None unless asked; at most kMaxSpares. A spare that exits is started
// again, until kMaxSpareFailures of them in a row exited without ever being taken: then the
// node goes on without spares (a warning says so).
inline constexpr int kDefaultSpares = 0;
inline constexpr int kMaxSpares = 8;
inline constexpr int kMaxSpareFailures = 3;
// A spare started beside running workers runs at this nice value until its take (where the
// agent may give it back: as root), so that its start does not slow the training steps.
inline constexpr int kSpareNice = 19;
// With --spares an agent starts its own workers warm too: before it first joins a round
// (a newcomer included) it starts them as spares and joins once each waits in await_rank();
// the survivors of a run it joins then wait for no interpreter. A program that does not get
// there within this long (or exits first) cannot wait as a spare: its workers start as usual.
inline constexpr std::chrono::seconds kSpareWarmTimeout{120};
inline constexpr milliseconds kDefaultReattachTimeout = std::chrono::seconds(30);
inline constexpr milliseconds kMaxReattachTimeout = std::chrono::hours(1);
// One run's record (RunRecord, serialized) in the run store; a larger one is not written (the
// run is then not durable: its old record is erased, and the server says so once).
inline constexpr std::size_t kMaxRunRecordBytes = 64 << 20;
// Endpoints one --rdzv_endpoint list may name (a,b,c: the agent tries them in turn).
inline constexpr std::size_t kMaxRdzvEndpoints = 16;

// --- Agent and launch ------------------------------------------------------------------
// Looking up a name (the rendezvous endpoint, this host's FQDN, the is_host check) goes
// through the system resolver (getaddrinfo: /etc/hosts and nsswitch), once, and gives up
// after this: a resolver that does not answer costs at most this, with one clear error.
inline constexpr milliseconds kResolveTimeout = std::chrono::seconds(10);
// A rendezvous name that does not exist *yet* (NXDOMAIN, no address: a Kubernetes headless
// service publishes a pod's name once the pod is ready) is looked up again this often, for up
// to the run's read_timeout (60 s by default), with one log line; then it is the error above.
inline constexpr milliseconds kNameRetryInterval = std::chrono::milliseconds(500);
// Bytes of a worker's error file (TORCHELASTIC_ERROR_FILE) the agent reads: room for a
// capped message and traceback even when JSON escaping sixfolds them. The rest of a larger
// file is not read; what it held is reported as cut.
inline constexpr std::size_t kMaxErrorFileReadBytes = 1 << 20;
// Hosts of one whole-cluster launch (--hosts, --hostfile): a longer list is refused.
inline constexpr std::size_t kMaxHosts = 4096;
// Hosts one Slurm host list (SLURM_STEP_NODELIST, ...) may expand to; a longer list is a
// usage error, refused before it is expanded. Also the bound on a scheduler's node count.
inline constexpr std::size_t kMaxSlurmHosts = 100000;

// --- Server-wide ---------------------------------------------------------------------
// Runs held at once (joining, running or within their finished grace); a Join that would
// create one more is refused with RESOURCE_EXHAUSTED.
inline constexpr std::size_t kMaxRuns = 4096;
// Events (events.h) the state machine keeps for a caller that does not drain them; the
// server drains after every call, so this only bounds a driver that never does (a test).
inline constexpr std::size_t kMaxPendingEvents = 1 << 16;
// Housekeeping: every kMemoryTrimInterval the server gives memory back to the system when
// malloc holds kMemoryTrimThreshold bytes more free than after its last trim (after a burst
// of large requests).
inline constexpr milliseconds kMemoryTrimInterval = std::chrono::seconds(2);
inline constexpr std::size_t kMemoryTrimThreshold = 1 << 20;
// rdzvd: allocations from this size are mmapped (and unmapped when freed), always.
inline constexpr std::size_t kMallocMmapThreshold = 256 << 10;
// HTTP/2 streams one connection may have open at once.
inline constexpr int kMaxConcurrentStreamsPerConnection = 64;

// --- Store -------------------------------------------------------------------------------
inline constexpr std::size_t kMaxStoreKeyBytes = 4096;
inline constexpr std::size_t kMaxStoreValueBytes = 4 << 20;
inline constexpr std::size_t kMaxStoreKeysPerRun = 100000;
// Keys plus values held by one run's table.
inline constexpr std::size_t kMaxStoreBytesPerRun = 256 << 20;
// Keys in one request (wait, multi_get, multi_set, check).
inline constexpr std::size_t kMaxStoreKeysPerRequest = 100000;
// One store request or reply on the wire (a value with its key and framing; a multi_get
// whose values would exceed it is refused with RESOURCE_EXHAUSTED).
inline constexpr std::size_t kMaxStoreMessageBytes = kMaxStoreValueBytes + (64 << 10);

// Large store replies (from kStoreReplyBudgetFrom bytes) written but not yet read by their
// clients, server-wide: beyond this a large reply is replaced by RESOURCE_EXHAUSTED ("retry
// later"), so clients that ask for big values and never read cannot grow the server.
inline constexpr std::size_t kMaxStoreUnreadReplyBytes = 128 << 20;
inline constexpr std::size_t kStoreReplyBudgetFrom = 64 << 10;

// --- The TCPStore-protocol store (torch's own client; tcpstore_server.h) -------------------
// Its keys, values and tables follow the Store limits above. One frame (a query with all its
// keys and values; a length field that says more is refused when it arrives):
inline constexpr std::size_t kMaxTcpStoreFrameBytes = kMaxStoreMessageBytes;
// Connections one world's listener holds (a run has one per round, AgentStores); one more is
// closed at once, with a log line.
inline constexpr std::size_t kMaxTcpStoreConnections = 20000;
// WAITs parked at once on one world's listener; a WAIT over it closes its connection.
inline constexpr std::size_t kMaxTcpStoreWaits = 20000;
// Replies a client has not read, per connection, before it is closed as not reading.
inline constexpr std::size_t kMaxTcpStoreUnsentBytes = 2 * kMaxStoreMessageBytes;
// How long a half-sent frame may sit unfinished before its connection is closed.
inline constexpr milliseconds kTcpStorePartialFrameTimeout = std::chrono::seconds(30);
// Worlds (rounds) of one run whose stores are kept: each world has a store of its own (a new
// world never sees an earlier one's keys); the newest one and the one before (whose workers may
// still be stopping) stay open, an older one is closed with its connections and keys.
inline constexpr std::size_t kTcpStoreWorldsKept = 2;

// --- The agent's relay of that store (store_relay.h, relay_service.h) --------------------
// Each agent serves the protocol on loopback for its node's workers and carries their queries
// to the server on one stream. On the server, one world's relayed connections and parked WAITs,
// from every node together (100,000 ranks of one world fit):
inline constexpr std::size_t kMaxRelayedConnectionsPerWorld = 250000;
inline constexpr std::size_t kMaxRelayedWaitsPerWorld = 250000;
// A relay message's frames are gathered up to this many bytes (one larger frame goes alone).
inline constexpr std::size_t kRelayBatchBytes = 256 << 10;
// One relay message on the wire, either way: a whole frame, or a connection's unsent replies,
// with the message's own fields.
inline constexpr std::size_t kMaxRelayMessageBytes = kMaxTcpStoreUnsentBytes + (64 << 10);
// Replies the server has for one agent's stream that the agent has not read yet; beyond it
// the stream is ended (RESOURCE_EXHAUSTED) and the agent reconnects.
inline constexpr std::size_t kMaxRelayUnsentBytes = 64 << 20;
// Queries an agent has for its stream that gRPC has not taken yet; beyond it the agent stops
// reading its workers' sockets, and reads on once the stream has taken half of them.
inline constexpr std::size_t kMaxRelayQueuedUpBytes = 64 << 20;
// What an agent keeps of its node's SETs per world, keys and values, to answer their reads
// itself (store_relay.h); a SET beyond it is not kept (its reads go to the server).
inline constexpr std::size_t kRelayCachedBytes = 64 << 20;
// A worker's SET (torch's protocol has no reply to it) waits in its agent for other queries to
// go up with it in one message to the server: kRelayWriteBehind, or kRelayWriteBehindMax if
// the node's workers sent more meanwhile (a node busy with queries its agent answers itself
// sends one message per kRelayWriteBehindMax, not one per kRelayWriteBehind).
inline constexpr std::chrono::microseconds kRelayWriteBehind{500};
inline constexpr std::chrono::microseconds kRelayWriteBehindMax{5000};
// How long an agent waits before it opens its stream again after losing it.
inline constexpr milliseconds kRelayReconnectInterval = std::chrono::milliseconds(100);
// The agent pings its stream's connection this often while nothing comes back, and takes it
// for lost when a ping is not answered within the timeout: a server gone silent (no FIN, no
// RST) is left within about 2 s, and the workers' connections move to the next one.
inline constexpr milliseconds kRelayKeepAliveInterval = std::chrono::seconds(1);
inline constexpr milliseconds kRelayKeepAliveTimeout = std::chrono::seconds(1);
// A new stream the server has not said it serves within this is given up for the next target
// (a server that accepts connections but answers nothing).
inline constexpr milliseconds kRelayReadyTimeout = std::chrono::seconds(2);

// The gRPC receive cap of the server (rendezvous and store share the port): the larger of
// the two services' messages. The Session reactor applies the tighter agent bound itself.
inline constexpr std::size_t kMaxServerReceiveBytes = kMaxRelayMessageBytes;

// launch --hosts (docs/cluster.md): ssh's connect timeout and its keep-alive (a host whose ssh
// session is silent for interval x count is taken as lost, as is the session); after a stop,
// how much longer than --shutdown_timeout the driver waits for an agent before ending its ssh.
inline constexpr milliseconds kSshConnectTimeout = std::chrono::seconds(10);
inline constexpr milliseconds kSshServerAliveInterval = std::chrono::seconds(5);
inline constexpr int kSshServerAliveCount = 3;
inline constexpr milliseconds kClusterStopMargin = std::chrono::seconds(10);

// --hang_timeout (docs/hangs.md): its bound, and how long a stalled worker's stack dump may
// take (gdb, or a Python worker's faulthandler) before the group is failed anyway.
inline constexpr milliseconds kMaxHangTimeout = std::chrono::hours(24);
inline constexpr milliseconds kStackDumpBudget = std::chrono::seconds(10);
// A progress report's phase name (the page holds 63 bytes and a NUL).
inline constexpr std::size_t kMaxProgressPhaseBytes = 63;
// The straggler watch (docs/stragglers.md, launch --watch_stragglers): a rank's own work per
// step (everything but its collective wait) against the median of the others'. A window closes
// when every rank went kStragglerWindowSteps steps past the last; a rank is slow in it at
// kStragglerRatio or more, named when slow in most of its last kStragglerWindows windows and
// cleared when slow in at most one of them. Agents sample the pages every
// kStragglerSampling. A progress report's phase kinds: at most kMaxPhaseKinds numbers.
inline constexpr double kStragglerRatio = 1.3;
inline constexpr int kStragglerWindowSteps = 6;
inline constexpr int kStragglerWindows = 5;
inline constexpr milliseconds kStragglerSampling = std::chrono::milliseconds(250);
inline constexpr int kMaxPhaseKinds = worker::kPhaseKinds;  // progress_page.h's kinds
// Slow links (docs/stragglers.md, "Slow links"): a node's link is slow below this share of
// the nodes' median (a third: tbf's bursts make healthy links' rates vary by 2x on the
// namespace hosts, a link capped to a fifth measured 17-22x below); each node's last
// kLinkReports reports (2 s at the agents' sampling) count. A progress report carries
// at most kMaxLinkReports links, each address at most kMaxLinkAddressBytes.
inline constexpr double kSlowLinkRatio = 1.0 / 3;
inline constexpr int kLinkReports = 8;
inline constexpr int kMaxLinkReports = 64;
inline constexpr std::size_t kMaxLinkAddressBytes = 64;
// launch --exclude_stragglers (docs/stragglers.md, "Exclusion"): how long an excluded node
// stays out (--straggler_cooldown; doubled each time the same node is excluded again), by
// default and at most; what a re-form is taken to cost until the run has measured one (its
// last in-place recovery's resumed time); how many excluded nodes a run remembers (the
// oldest whose cool-down is over go first).
inline constexpr milliseconds kDefaultStragglerCooldown = std::chrono::minutes(5);
inline constexpr milliseconds kMaxStragglerCooldown = std::chrono::hours(24);
inline constexpr milliseconds kDefaultReformCost = std::chrono::seconds(1);
inline constexpr int kMaxExcludedNodes = 1000;
// launch --health_check: how long the command may take (--health_check_timeout), by default
// and at most.
inline constexpr milliseconds kDefaultHealthCheckTimeout = std::chrono::seconds(60);
inline constexpr milliseconds kMaxHealthCheckTimeout = std::chrono::hours(1);
// --max_restarts_without_progress: a Join's larger value is clamped to this.
inline constexpr int kMaxRestartsWithoutProgress = 1000000;
// After a stop has sent SIGKILL, how long the agent waits for its workers to be reaped before
// it reads their states: one in uninterruptible sleep (state D) is left behind
// (agent/proc_state.h), so that a worker stuck in the kernel cannot hold the job forever.
inline constexpr milliseconds kUnkillableWait = std::chrono::seconds(5);

// rdzvd --etcd (docs/rendezvous.md, "Replicated rdzvd on etcd"). The lease that holds a
// replica's leadership (etcd's floor is about 2 s with its default timing): a dead leader is
// replaced about this long after it died.
inline constexpr milliseconds kDefaultEtcdLeaseTtl = std::chrono::seconds(2);
inline constexpr milliseconds kMaxEtcdLeaseTtl = std::chrono::minutes(1);
// How long one etcd call (and its retries through another member) may take; a write that has
// not succeeded by then ends the leader (it may no longer lead).
inline constexpr milliseconds kEtcdRequestTimeout = std::chrono::seconds(5);
// One attempt of an etcd call is bounded by the lease TTL divided by this (a renewal: by
// twice as much), so that a member that went silent (no answer, no reset) costs one attempt
// and the call goes on to another member well inside the lease; never less than
// kEtcdMinAttempt. Long waits (a standby's campaign, the leader observer) are asked again
// after one lease TTL, on whichever member answers.
inline constexpr int kEtcdAttemptsPerLease = 2;
inline constexpr milliseconds kEtcdMinAttempt = std::chrono::milliseconds(100);
// A leader whose renewals have not got through steps down this share of the lease TTL
// before the lease can expire (1/N of it): before any standby can win.
inline constexpr int kEtcdStepDownMarginDivisor = 10;
// How often rdzvd pings each etcd member's connection (etcd refuses pings closer than 5 s).
inline constexpr milliseconds kEtcdKeepAlive = std::chrono::seconds(6);
// Within etcd's defaults (--max-txn-ops 128, --max-request-bytes 1.5 MiB): the most operations
// and bytes one transaction of ours holds. A round's node keys take as many as they need.
inline constexpr int kEtcdMaxOpsPerTxn = 120;
inline constexpr std::size_t kEtcdMaxTxnBytes = 1 << 20;
// How many of a round's node-key transactions are in flight at once.
inline constexpr std::size_t kEtcdConcurrentTxns = 16;
// A range read's page (keys per call), so a reply stays far below gRPC's 4 MiB.
inline constexpr int kEtcdRangePage = 1000;
// A standby holds an agent's stream (answering its keep-alives) for up to this long past the
// lease, waiting to lead, before it tells the agent to try the next endpoint.
inline constexpr milliseconds kStandbyHoldMargin = std::chrono::seconds(1);
// Messages a standby keeps per held stream (a Join and what follows it) before it ends it.
inline constexpr std::size_t kStandbyMaxHeldMessages = 16;

}  // namespace muster::rendezvous::limits
