// The agent's session rules, as a pure state machine: what a node does with its stream to the
// rendezvous server and with its workers, from the first Join to launch's exit code.
//
// Events go in (the stream opened or ended, a message heard, a timer due, the workers
// started, one failed, the group gone, a signal), each with the time it happened; what to do
// comes out as a list of Actions, in order (open a stream, send, start or stop the workers,
// arm a timer, log, exit). No sockets, no processes, no clock of its own: agent.cc carries
// the actions out, and the unit tests drive every transition with a fake clock
// (tests/unit/session_machine_test.cc). docs/architecture.md shows where it sits.
//
// The phases: Joining (a Join sent, no round yet) -> Running (this round's workers run) ->
// AwaitingDone (they all succeeded; the server confirms the run's end) or Stopping (they are
// being stopped; `after` says what comes next: the server's word, a rejoin, a reconnect, the
// failure summary, or exit) -> Exiting. Beside the phase, the stream's own state: whether the
// server was ever reached, and the three bounded waits (the first wait for a server, a
// re-attach after a lost stream, a rejoin after a lost server), and the probe.
//
// The probe (docs/rendezvous.md, "Silence: a probe before a verdict"). A node in a round that
// hears nothing for kProbeAfterIntervals keep-alive intervals (the server answers every one)
// does not wait for the whole window with its old stream: that stream may be stuck in TCP's
// back-off after a blip, or its server may be gone while another replica is there. It opens
// fresh connections, one endpoint after the other starting with its own, each for at most
// a tenth of an interval, and on each asks for its place back (a re-attach Join, then a
// keep-alive); the workers keep running and the old stream stays open meanwhile.
//  - An Attached on a probe (the server that holds the round, reached again, or a new
//    leader) makes the probe the stream: the server closed the old one, nothing restarts.
//  - A keep-alive answered without Attached is a standby holding the Join: another replica
//    is there and may lead soon. The probe goes on to the next endpoint.
//  - Anything heard on the old stream ends the probe: it was only slow. But an attempt open
//    at that moment may have delivered its Join already, and its server then moves the node
//    to it and closes the old stream: it is let finish (for at most one interval). Attached:
//    it is adopted as above; anything else: it is closed and the old stream kept (or, if
//    the old one ended meanwhile, that end is handled then).
//  - At the end of the window with no Attached: when a standby answered and the round keeps
//    its runs (re-attach), the node re-attaches, as after a lost stream, and its workers keep
//    running; otherwise it is out, as before the probe: it stops its workers and rejoins.
//
// In-place recovery (docs/in_place.md; session_in_place.cc), with Config::in_place and every
// living worker of the node having declared support over its control channel:
//  - One of ours failed: it is reported, the survivors are told to abort (AbortWorkers), and
//    the node waits in Recovering for the server's Restart, its survivors running.
//  - The server's Restart (any node's failure or loss): AbortWorkers, a Join, and the node
//    waits in Reforming for the next round, its survivors still running.
//  - The Assignment: ReformWorkers (the survivors get the new world, each dead worker a new
//    process), back to Running; every worker must report `resumed` for this round within
//    in_place_timeout (Timer::kInPlace). All of them did: kInPlaceResumed. One did not, or
//    answered for another round: the node falls back (kInPlaceFallback): it reports a
//    failure, stops its workers, and the restart that follows is the full one.
// Without support (a worker that never declared it) every rule is the full restart's.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "muster/agent/agent_events.h"
#include "muster/agent/endpoints.h"
#include "muster/v1/rendezvous.pb.h"

namespace muster::agent {

// launch's exit code when the job failed for good and should not be run again as it is: it
// kept failing before any rank made a step (--max_restarts_without_progress; docs/hangs.md).
inline constexpr int kExitDoNotRequeue = 3;

// The agent's keep-alives go out this many times per keep_alive_interval (the unit of the
// liveness window), and the server answers each: when a cut begins, the last word each end
// heard from the other is at most a fifth of an interval old, not a whole one, so a blip of
// 90% of the window still leaves most of the window's last tenth for the path back
// (docs/rendezvous.md, "Blips").
inline constexpr int kKeepAlivesPerInterval = 5;
// ...but a run's nodes together send their server at most this many keep-alives a second
// (each answered): a node in a round of N nodes sends floor(budget x interval / N) per
// interval, at most kKeepAlivesPerInterval and at least one. At the default 0.5 s interval,
// rounds of up to 1,000 nodes get five, of 2,500 two, of 5,000 or more one (the rule before
// the five). rdzvd answers each keep-alive on its one decision thread: 10,000 a second took
// about two thirds of a core here (bench/README.md, "keepalive"), and 100,000 (10,000 nodes
// at five) are more than it answers. A round that sends fewer survives blips of less of its
// window (docs/rendezvous.md, "Blips").
inline constexpr int kKeepAliveBudgetPerSecond = 10'000;
// The keep-alives per interval for a round of `nodes` nodes (before any round: the most).
int keep_alives_per_interval(std::chrono::milliseconds interval, int nodes);
// A node in a round probes its server after this many keep-alive intervals of silence (when
// that is less than the liveness window: keep_alive_max_attempt above it).
inline constexpr int kProbeAfterIntervals = 2;
// Each probe attempt waits for its connection at most this share of an interval (50 ms by
// default), then the next one sends a fresh SYN: after a blip the path back is found within
// about that, where one attempt's own SYN would be sent again only after 1 s (TCP's initial
// retransmission timeout). At least kMinProbeAttempt.
inline constexpr int kProbeAttemptsPerInterval = 10;
inline constexpr std::chrono::milliseconds kMinProbeAttempt{20};

namespace session {

using Clock = std::chrono::steady_clock;
using Time = Clock::time_point;

// The machine's timers; agent.cc holds one of each. Arming one again moves it.
enum class Timer {
  kKeepAlive,  // the next keep-alive to send
  kSilence,    // the end of the liveness window since the server was last heard
  kReopen,     // a new stream to open (armed for "now": the next turn of the loop)
  kProbe,      // the next probe to open (armed for "now")
  kInPlace,    // the end of the wait for an in-place round's workers to report resumed
  kCooldown,   // an excluded straggler's cool-down is over: it joins again
  kPreflight,  // the pre-flight named another node: the end of the wait for it to leave
};
inline constexpr int kTimers = 7;

enum class Level { kDebug, kInfo, kWarn, kError };

// --- actions ------------------------------------------------------------------------------

// Close the current stream (if any) and open a new one to `endpoint`.
struct OpenStream {
  RdzvEndpoint endpoint;
  bool wait_for_ready = false;
  std::chrono::milliseconds connect_timeout{0};
};
struct CloseStream {};
// Open a probe (a second stream, beside the current one) to `endpoint` and write `msgs` on
// it; a probe open already is closed first. Its messages and its end come back as
// on_probe_message and on_probe_closed. A Join goes with master_port_candidate unset, as in
// Send.
struct OpenProbe {
  RdzvEndpoint endpoint;
  std::chrono::milliseconds connect_timeout{0};
  std::vector<v1::AgentMsg> msgs;
};
struct CloseProbe {};
// The probe becomes the current stream: the current one is closed, and the probe's messages
// and end come back as on_message and on_stream_closed from now on.
struct AdoptProbe {};
// Write `msg` on the current stream. A Join goes with master_port_candidate unset: the sender
// fills in a free port of this host.
struct Send {
  v1::AgentMsg msg;
};
// Spawn this round's workers, then report on_workers_started or on_spawn_failed.
struct StartWorkers {
  v1::Assignment assignment;
};
// launch --preflight (docs/stragglers.md, "Pre-flight"): measure this node's compute and its
// links to the round's other nodes, before the first round's workers start; then report
// on_preflight_done.
struct RunPreflight {
  v1::Assignment assignment;
};
// Signal every worker's process group (SIGKILL follows after the shutdown grace); the group
// reports on_group_gone once every worker is reaped and its output drained.
struct StopWorkers {
  int signal = 0;
};
// In-place recovery: every running worker is to abort its collectives now (`round`: the
// round coming, 0 when not known yet).
struct AbortWorkers {
  int round = 0;
};
// In-place recovery: the running workers get this round's world; each dead one is replaced
// by a new process. Then on_workers_reformed, or on_spawn_failed.
struct ReformWorkers {
  v1::Assignment assignment;
  std::vector<int> lost_ranks;  // the round before's global ranks whose nodes left (Restart's)
  // Local ranks whose process is alive but is a replacement that has not declared yet (still
  // starting: an interpreter importing torch): it holds no state, so a new process for this
  // round takes its place, as for a dead one (it would otherwise start in a stale world).
  std::vector<int> replace;
};
struct KillWorkers {};     // a second signal: SIGKILL now, no grace left
struct ReleaseWorkers {};  // the stopped round's workers are forgotten (their pids may be reused)
// --hang_timeout: dump the stalled rank's stacks, then report on_hang_dumped.
struct DumpStalled {
  int rank = 0;
  std::string description;
};
struct ArmTimer {
  Timer timer;
  Time at;
};
struct CancelTimer {
  Timer timer;
};
struct Emit {
  AgentEvent event;  // `wall` is left for the sender to stamp
};
struct Log {
  Level level;
  std::string text;
};
// The run failed: torchrun's failure summary (and its hints, launch's own error file).
struct PrintFailure {
  v1::Fail fail;
};
// The job is over: launch exits with `code`. `signal`: the signal that stopped it (its
// SignalException goes to launch's own error file), 0 for none.
struct Exit {
  int code = 0;
  int signal = 0;
};

using Action = std::variant<OpenStream, CloseStream, OpenProbe, CloseProbe, AdoptProbe, Send,
                            StartWorkers, RunPreflight, StopWorkers, AbortWorkers, ReformWorkers, KillWorkers,
                            ReleaseWorkers, DumpStalled, ArmTimer, CancelTimer, Emit, Log,
                            PrintFailure, Exit>;
using Actions = std::vector<Action>;

// What the machine needs to know of the node and its run.
struct Config {
  std::string run_id;
  std::vector<RdzvEndpoint> endpoints;  // the first is tried first
  bool wait_for_server = false;
  // The wait for the server at the start (wait_for_server) and after a lost server.
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(60)};
  std::chrono::milliseconds keep_alive_interval{500};
  int keep_alive_max_attempt = 4;
  int nproc_per_node = 1;
  // --in_place and --in_place_timeout (see the header comment).
  bool in_place = false;
  std::chrono::milliseconds in_place_timeout{std::chrono::seconds(30)};
  // --preflight, and how long the nodes wait for a node it named to leave before their
  // workers start anyway (agent.cc gives preflight::kStoreWait).
  bool preflight = false;
  std::chrono::milliseconds preflight_wait{std::chrono::seconds(30)};
  // Every Join this node sends: the node, its run's rules (agent.cc's join_template). The
  // machine adds the re-attach fields.
  v1::Join join;
};

// What the pre-flight found (RunPreflight's answer): whether it ran (`error`: why not); this
// node named (`named_me`: why, one line); the other nodes it named ("node 2 (why)").
struct PreflightVerdict {
  bool ran = true;
  std::string error;
  std::string named_me;
  std::vector<std::string> named_others;
};

class SessionMachine {
 public:
  // kRecovering and kReforming: in-place recovery (see above); the survivors run meanwhile.
  enum class Phase {
    kJoining,
    kRunning,
    kStopping,
    kAwaitingDone,
    kExiting,
    kRecovering,
    kReforming
  };
  // What follows once the stopping group has fully exited.
  // kCooldown: this node was excluded as a straggler (Restart.excluded_ms): it waits out its
  // cool-down, connected and running nothing (kJoining, cooling()), then joins again.
  enum class After { kNone, kRejoin, kReconnect, kFail, kExit, kCooldown };

  explicit SessionMachine(Config config);

  // The first stream and Join, and the keep-alives.
  Actions start(Time now);

  // The stream is up: the server was reached.
  Actions on_stream_ready(Time now);
  Actions on_message(const v1::ServerMsg& msg, Time now);
  // The stream ended (OK after Done/Fail, else the server's or the transport's error).
  Actions on_stream_closed(const absl::Status& status, Time now);
  Actions on_timer(Timer timer, Time now);
  // The probe's messages, and its end (the attempt timed out, was refused, or its stream
  // broke), until AdoptProbe or CloseProbe.
  Actions on_probe_message(const v1::ServerMsg& msg, Time now);
  Actions on_probe_closed(const absl::Status& status, Time now);

  // After StartWorkers: `workers` processes run.
  Actions on_workers_started(int workers, Time now);
  // After StartWorkers: a worker could not be started (those that did run on).
  Actions on_spawn_failed(const v1::WorkerFailure& failure, Time now);
  // A worker of this round exited with a failure (not one being dumped for a hang).
  Actions on_worker_failed(const v1::WorkerFailure& failure, Time now);
  // A stalled worker's stacks are written; `failure` names the hang.
  Actions on_hang_dumped(const v1::WorkerFailure& failure, Time now);
  // Every worker of the round (`workers` of them; 0 when none ran) is reaped and its output
  // drained. May come more than once; only the first in a phase counts.
  Actions on_group_gone(int workers, Time now);
  // A progress sample of this node's ranks (a Progress message without its round).
  Actions on_progress(v1::AgentMsg msg, Time now);
  // In-place recovery: a worker declared support on its control channel; one reported it
  // completed a step in `round`; after ReformWorkers, `replaced` new processes run.
  Actions on_worker_declared(int local_rank, Time now);
  Actions on_worker_resumed(int local_rank, int round, Time now);
  Actions on_workers_reformed(int replaced, Time now);
  // After RunPreflight for the round `round` (session_preflight.cc; docs/stragglers.md,
  // "Pre-flight"): nothing named, or it could not run, the workers start; this node named,
  // it leaves the run with one line and exit 1, its workers never started; another node
  // named, the workers wait for the round without it (its stream's end restarts this one),
  // or start after preflight_wait if it never leaves. A verdict for a round that is over
  // does nothing.
  Actions on_preflight_done(int round, const PreflightVerdict& verdict, Time now);
  // A signal launch received: the node leaves; a second one skips the grace.
  Actions on_signal(int sig, Time now);

  Phase phase() const { return phase_; }
  After after() const { return after_; }
  bool exiting() const { return phase_ == Phase::kExiting; }
  // The run failed and the failure summary was printed.
  bool failed() const { return phase_ == Phase::kExiting && after_ == After::kFail; }
  int exit_code() const { return exit_code_; }
  const v1::Assignment& assignment() const { return assignment_; }
  // The endpoint in use (its host is MASTER_ADDR for the agent store), and the others in
  // the order this node would try them.
  const Endpoints& endpoints() const { return endpoints_; }
  // Whether the node is attached to its round (its reports are sent, not held).
  bool attached() const { return attached_; }
  // Whether a probe is under way (see the probe, above).
  bool probing() const { return probing_; }
  // Excluded as a straggler, waiting out the cool-down (see After::kCooldown).
  bool cooling() const { return cooling_; }

 private:
  class Step;  // one event's actions, being collected

  void send_join(Step& s);
  void excluded(Step& s, const v1::Restart& r);
  v1::AgentMsg join_message(bool reattach, bool in_place = false) const;
  void open_stream(Step& s, bool wait_for_ready, std::chrono::milliseconds connect_timeout);
  void reopen_soon(Step& s, std::optional<Time>* deadline, bool reattach);
  void heard(Step& s);
  void arm_silence(Step& s);
  void stop_silence(Step& s);
  Time silence_due() const;
  void on_silence(Step& s);
  void handle(Step& s, const v1::ServerMsg& m);
  bool can_probe() const;
  void start_probe(Step& s);
  void open_probe(Step& s);
  void end_probe(Step& s);
  void adopt_probe(Step& s);
  void settle_probe(Step& s);
  void end_settled_probe(Step& s);
  void stream_closed(Step& s, const absl::Status& status);
  void enter_round(Step& s, const v1::Assignment& a);
  void on_assignment(Step& s, const v1::Assignment& a);
  void on_attached(Step& s, const v1::Attached& a);
  bool can_reattach() const;
  void reattach(Step& s, const std::string& why);
  void lost_server(Step& s, const std::string& why);
  void never_reached(Step& s, const std::string& why);
  void send_report(Step& s, const v1::AgentMsg& msg);
  void report_failure(Step& s, const v1::WorkerFailure& f, bool in_place_fallback = false);
  void stop(Step& s, int sig);
  void exit_with(Step& s, int code);
  void finish(Step& s, int code);
  void after_group_gone(Step& s, int workers);
  void noticed(Step& s, const char* cause);
  AgentEvent event(AgentEvent::Kind kind, Time now) const;
  // In place (session_in_place.cc).
  bool in_place_ready() const;
  bool recover_in_place(Step& s, const char* cause);
  void on_reform(Step& s, const v1::Assignment& a);
  void fall_back(Step& s, const std::string& why);
  void in_place_due(Step& s);
  void reset_in_place();
  // The pre-flight (session_preflight.cc).
  void start_workers(Step& s);
  void preflight_due(Step& s);

  const Config config_;
  const std::chrono::milliseconds window_;  // the liveness window
  const std::chrono::milliseconds probe_after_;  // silence that starts a probe
  std::chrono::milliseconds beat_;               // between two keep-alives (the round's size)
  Endpoints endpoints_;
  Phase phase_ = Phase::kJoining;
  After after_ = After::kNone;
  v1::Assignment assignment_;
  v1::Fail fail_;

  // The stream.
  bool reached_ = false;  // the server has been heard from (on any stream)
  Time last_heard_{};
  bool silence_armed_ = false;
  Time silence_at_{};  // when the armed silence timer is due
  // The first wait for a server (wait_for_server), over every endpoint.
  std::optional<Time> first_deadline_;
  // After a lost server, until it is heard from again: back in touch by then, or exit.
  std::optional<Time> rejoin_deadline_;
  // Re-attach: between the loss of a stream and the server's Attached, the node is not
  // attached (its reports wait); the attempts end at the deadline.
  bool attached_ = true;
  std::optional<Time> reattach_deadline_;
  Time reattach_since_{};
  // The stream kReopen opens: until which deadline, and whether it re-attaches.
  std::optional<Time>* reopen_deadline_ = nullptr;
  bool reopen_reattach_ = false;

  // The probe: under way; the endpoint of its attempt (endpoints_.after(probe_k_)); whether
  // an attempt is open; since when; whether a standby answered one.
  bool probing_ = false;
  std::size_t probe_k_ = 0;
  bool probe_open_ = false;
  Time probe_since_{};
  bool standby_heard_ = false;
  // The old stream was heard while an attempt was open, whose re-attach Join may have reached
  // the server already (which then moves the node to it and closes the old stream): the
  // attempt is let finish, no new one starts (see "The probe" above). old_closed_: how the old
  // stream ended meanwhile, for when the attempt fails too.
  bool probe_settling_ = false;
  Time settle_since_{};
  std::optional<absl::Status> old_closed_;

  // This round's reports.
  std::optional<v1::AgentMsg> last_report_;
  bool failure_reported_ = false;
  bool stopped_emitted_ = false;
  std::optional<Recovery> recovery_;  // from the first sign the round is over
  int signal_ = 0;
  // Excluded as a straggler: the cool-down the server gave, and whether it is under way.
  std::chrono::milliseconds cooldown_{0};
  bool cooling_ = false;
  // --preflight: run once (the first round); a named node awaited in round preflight_round_.
  bool preflight_started_ = false;
  bool preflight_waiting_ = false;
  int preflight_round_ = 0;
  int exit_code_ = 1;

  // In place, by local rank: declared support; failed in this round; reported resumed. The
  // in-place round waits for every `resumed` (reform_pending_); in_place_off_: the last one
  // fell back, so the next restart is the full one.
  std::vector<bool> declared_, dead_, resumed_;
  // A replacement started by an in-place re-form, until it declares: it counts as ready for
  // the next recovery (and is replaced in it), since the program is known to support it.
  std::vector<bool> fresh_;
  bool reform_pending_ = false;
  Time reform_due_{};  // the end of the wait for `resumed`
  bool in_place_off_ = false;
  bool supports_ = false;  // some worker of this node declared support (the program can)
  std::vector<int> lost_ranks_;  // the Restarts' lost ranks since the last round formed
};

}  // namespace session
}  // namespace muster::agent
