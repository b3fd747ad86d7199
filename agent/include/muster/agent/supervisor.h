// Keeps everything a job's workers start from outliving the job, however `launch` ends.
//
// Workers die with the agent (PR_SET_PDEATHSIG), but what they start (a child, a data-loader
// process, a daemon that called setsid) does not. So `launch` forks, first thing in main
// while it has one thread, a small supervisor process that outlives it: it holds the read end
// of a pipe whose write end only `launch` has, and when that pipe reads EOF (launch exited,
// however, kill -9 included) it kills what is left of the job, removes launch's private
// temporary folder if launch has not, and exits.
//
// What it kills:
// - cgroup v2, where launch's own cgroup is writable (and has cgroup.kill, Linux 5.14): a
//   cgroup of the job's own, `muster-<pid>` under launch's, which each worker joins before
//   exec. cgroup.kill kills every process in it, including those that left their process
//   group or session; the supervisor then waits for "populated 0" and removes it.
// - Otherwise (or with MUSTER_CGROUP=0): each worker's process group, whose id launch sends
//   over the pipe as it spawns it; a process that moved to another group or session escapes.
//
// Threads: the methods are called from the agent's thread (the main thread); the supervisor
// is a separate process with nothing shared but the pipe.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>

namespace muster::agent {

class JobSupervisor {
 public:
  // Forks the supervisor. REQUIRES: no thread has been started yet (a fork copies only the
  // calling thread, and the supervisor runs on in that copy). `allow_cgroup` false forces the
  // process-group fallback (launch passes MUSTER_CGROUP != "0"). Returns nullptr when the
  // fork fails; the job then runs without one (workers still die with launch).
  static std::unique_ptr<JobSupervisor> start(bool allow_cgroup);

  ~JobSupervisor();  // finish(0)
  JobSupervisor(const JobSupervisor&) = delete;
  JobSupervisor& operator=(const JobSupervisor&) = delete;

  // The job cgroup's cgroup.procs (close-on-exec), which a forked worker writes "0" to, to
  // join it; -1 in the process-group fallback.
  int cgroup_procs_fd() const { return procs_fd_; }
  // "cgroup <path>" or "process groups": what contains the job, for logs and tests.
  std::string mechanism() const;
  pid_t pid() const { return pid_; }

  // The supervisor kills this process group when launch ends (both mechanisms: it also
  // covers a worker whose cgroup write failed).
  void track_group(pid_t pgid);
  // The group has been killed and reaped: its id may be reused, so it must not be killed later.
  void forget_group(pid_t pgid);

  // The supervisor removes this folder (launch's private temporary folder) when launch has
  // ended, if it is still there (kill -9, also while launch was removing it itself).
  void track_folder(const std::string& path);
  // The folder is to be kept after all (a failed job's error files): it is not removed.
  void forget_folder();

  // Kills every process left in the job cgroup now (every worker has exited; what remains was
  // started by them). A no-op in the process-group fallback.
  void kill_cgroup();

  // A normal end: closes the pipe (the supervisor kills what is left and removes the cgroup),
  // waits at most `wait` for it to finish, and removes the cgroup when it is empty. After a
  // timeout the supervisor goes on by itself. Safe to call twice.
  void finish(std::chrono::milliseconds wait);

 private:
  JobSupervisor() = default;
  void send(char op, pid_t pgid, const std::string& text = "");

  pid_t pid_ = -1;
  int pipe_fd_ = -1;   // write end: EOF there is the supervisor's signal
  int procs_fd_ = -1;  // the job cgroup's cgroup.procs
  int kill_fd_ = -1;   // the job cgroup's cgroup.kill
  std::string cgroup_dir_;
};

}  // namespace muster::agent
