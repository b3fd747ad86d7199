// One round's workers on this node, as processes: spawned with their environment, watched by
// pidfd, their output split into prefixed console lines and log files, stopped (SIGTERM, then
// SIGKILL after the grace), their process groups and the job's cgroup cleared, a worker stuck
// in the kernel left behind, a stalled one's stacks dumped. It decides nothing: what to do
// about an exit is the session machine's (session_machine.h); agent.cc wires the two.
//
// Everything runs on the io_context given to the constructor; callbacks come from it and may
// call back into the group.
#pragma once

#include <sys/types.h>

#include <boost/asio/io_context.hpp>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "muster/agent/agent_options.h"
#include "muster/agent/file_timer.h"
#include "muster/agent/hang_watch.h"
#include "muster/agent/worker_env.h"
#include "muster/v1/rendezvous.pb.h"

namespace muster::agent {

class WorkerGroup {
 public:
  struct Callbacks {
    // A worker of this round exited with a failure (one being dumped for a hang excepted):
    // its exit, its error file, its file timer when the watchdog killed it.
    std::function<void(const v1::WorkerFailure&)> failed;
    // A stalled worker's stacks are written (or their budget is spent).
    std::function<void(const v1::WorkerFailure&)> hang_dumped;
    // A worker was reaped or left behind, or a pipe drained: gone() may now hold.
    std::function<void()> changed;
    // A progress sample of this round's ranks (--hang_timeout, or a budget that knows it).
    HangWatch::Sample progress;
    // --in_place (control channel, docs/in_place.md): a worker declared in-place support
    // (`hello`), or reported that it completed a step in `round` (`resumed`).
    std::function<void(int local_rank)> declared;
    std::function<void(int local_rank, int round)> resumed;
  };

  // `options` must outlive the group.
  WorkerGroup(boost::asio::io_context& io, const AgentOptions& options, Callbacks callbacks);
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  struct Started {
    int workers = 0;
    // The worker that could not be started (exit code 127); the ones before it run.
    std::optional<v1::WorkerFailure> failure;
  };
  // Spawns the round's nproc_per_node workers; `spec` holds what every worker of the round
  // shares (local rank and error file are set per worker). Releases the last round first.
  Started start(const v1::Assignment& assignment, const WorkerEnvSpec& spec);

  // In-place recovery (--in_place). abort_all: every running worker's collectives are to
  // fail now (`abort`; `round`: the round coming, 0 if not known yet). reform: the running
  // workers are told the new round's world (`world`, with the round before's ranks whose
  // nodes left), each dead one, and each local rank in `replace` (a replacement that has
  // not declared yet: killed, its exit not a failure), is replaced by a new process with the
  // round's environment; `failure` when a replacement could not start.
  void abort_all(int round);
  Started reform(const v1::Assignment& assignment, const WorkerEnvSpec& spec,
                 const std::vector<int>& lost_ranks, const std::vector<int>& replace = {});

  // Sends `sig` to every worker's process group; SIGKILL follows after the shutdown grace.
  void stop(int sig);
  // SIGKILL now (a second signal).
  void kill_now();
  // Every worker reaped (or left behind in the kernel) and its output drained.
  bool gone() const;
  int size() const { return static_cast<int>(workers_.size()); }
  // Forgets the (reaped, killed) workers; their group ids may now be reused.
  void release();

  // --hang_timeout: the server found rank `rank` of this node stalled; its stacks go to
  // stacks.txt beside its logs, then hang_dumped.
  void dump_stalled(int rank, const std::string& description);
  // A worker's file timer expired (torch's FileTimerServer rule): the timer's signal to it.
  void on_file_timer(const FileTimerTable::Expired& expired);
  void set_file_timers(FileTimerServer* timers) { file_timers_ = timers; }

  // The ModuleNotFoundError hint for the first of this node's workers whose failure shows
  // one: the root cause when it is ours (its error file), else any worker's stderr tail.
  std::string python_hint(const v1::WorkerFailure& root, int group_rank) const;

  // The job is over: no more timers; workers left behind in the kernel are named; the
  // spares are killed.
  void end();

  // --spares (docs/in_place_torch.md, "Warm spares"): once a worker said the program can wait
  // as a spare (`hello spare=1`), the group keeps opts.spares processes of the program
  // started with MUSTER_SPARE=1 and no rank; each says `hello spare=1` when it waits in
  // muster_inplace.await_rank(). reform() gives a dead local rank's place to a ready spare
  // (`take`, with the variables of that rank's environment that differ from the spare's)
  // instead of starting a process, and starts another spare. A spare's exit is not a
  // failure: it is started again, up to limits::kMaxSpareFailures in a row. stop() and end()
  // kill them; the next start() starts them again.
  int ready_spares() const;
  // Spares started and not yet reaped, ready or not.
  int live_spares() const;
  // Before the first round (with --spares): nproc_per_node spares started with `spec`'s
  // environment; `done` once every one is ready, or once the program showed it cannot wait
  // as one (a spare exited first, or limits::kSpareWarmTimeout passed: they are killed).
  // start() then hands each local rank a ready spare (`take`) before it starts a process.
  void warm_up(const v1::Assignment& assignment, const WorkerEnvSpec& spec,
               std::function<void()> done);

 private:
  struct Pipe;
  struct Worker;
  struct Hang;
  struct OwnedFd {
    int fd = -1;
    void reset();
    ~OwnedFd() { reset(); }
  };

  v1::WorkerFailure describe(const Worker& w) const;
  // start() and reform(): one worker of the round, at the back of workers_.
  std::optional<v1::WorkerFailure> spawn_one(int lr, const v1::Assignment& a,
                                             const WorkerEnvSpec& round, bool watch_progress,
                                             bool spare = false);
  // The environment of local rank `lr` in the round (its folder, error file and progress page
  // set on `w`).
  std::map<std::string, std::string> worker_env(int lr, const v1::Assignment& a,
                                                const WorkerEnvSpec& round, bool watch_progress,
                                                Worker& w);
  // Spares: started up to opts.spares; one taking local rank `lr` (false: none ready, or
  // the rank's environment cannot be said in a `take`); one exited; all killed.
  void top_up_spares();
  bool take_spare(int lr, const v1::Assignment& a, const WorkerEnvSpec& round,
                  bool watch_progress);
  void on_spare_exit(Worker& w, int status);
  void kill_spares();
  void warm_done(const std::string& why);
  void watch_round(const v1::Assignment& a, bool watch_progress);
  void read_control(Worker* w);
  void send_control(Worker& w, const std::string& packet);
  std::unique_ptr<Pipe> make_pipe(int fd, const std::string& prefix, int lr, int bit, int console,
                                  const std::string& log);
  void open_filtered_logs(const std::string& attempt_dir);
  void read_pipe(Worker* w, Pipe* p);
  void watch_exit(Worker* w);
  void on_exit(Worker& w, int status);
  void finish_hang();
  bool all_reaped() const;
  void signal_groups(int sig);
  void arm_unkillable_timer();
  void leave_stuck_workers();
  void arm_drain_timer();
  void check_gone();
  static void cancel_pipes(Worker& w);

  boost::asio::io_context& io_;
  const AgentOptions& opts_;
  Callbacks cb_;
  int group_rank_ = 0;
  bool stopping_ = false;
  bool ended_ = false;
  std::vector<std::unique_ptr<Worker>> workers_;
  // Workers of earlier rounds left behind in the kernel (state D), until they are reaped.
  std::vector<std::unique_ptr<Worker>> abandoned_;
  // Dead workers replaced in place, kept while their pipes may still drain (the next re-form
  // drops those that are done).
  std::vector<std::unique_ptr<Worker>> retired_;
  // --spares: the processes waiting, whether the program said it can wait as one, how many
  // exited in a row without being taken, and the round they are started for.
  std::vector<std::unique_ptr<Worker>> spares_;
  bool spare_capable_ = false;
  int spare_failures_ = 0;
  int spares_made_ = 0;
  std::function<void()> warm_done_;  // while warming up
  std::optional<v1::Assignment> spare_round_;
  WorkerEnvSpec spare_spec_;
  OwnedFd filtered_[2];  // this attempt's filtered_std{out,err}.log (-1: no filters, no file)
  std::unique_ptr<HangWatch> hang_watch_;
  std::chrono::milliseconds hang_timeout_{0};
  std::unique_ptr<Hang> hang_;  // this round's stalled worker, while it is dumped
  std::unique_ptr<StackDump> stack_dump_;
  FileTimerServer* file_timers_ = nullptr;
  struct Timers;
  std::unique_ptr<Timers> timers_;
};

}  // namespace muster::agent
