// A real etcd cluster for tests: Debian's etcd-server 3.4 (etcd, found on PATH) members on
// 127.0.0.1, and etcd-client's etcdctl (on PATH, ETCDCTL_API=3) for the tests' own
// checks. start() starts it, the destructor ends it.
//
// Each member i is named m<i> and gets a client port and a peer port from free_port() (all
// distinct), a data dir <dir>/m<i> and a log <dir>/m<i>.log (its stderr, zap at level warn,
// appended across restarts), where <dir> is one fresh temp folder (mkdtemp) per cluster,
// removed by the destructor. --initial-cluster lists every member, --initial-cluster-token is
// unique per cluster (the temp folder's name), heartbeat and election timeout come from
// EtcdOptions.
//
// Readiness is an event, not a poll: each member is started with NOTIFY_SOCKET set to an
// abstract unix datagram socket of ours, and etcd sends "READY=1" there (sd_notify) once it
// has joined the cluster (published itself through raft, so a quorum was up). A member that
// exits instead is seen at once through its pidfd, and its log is quoted in the error. If a
// member could not bind because a port was taken after free_port() checked it, start() tries
// once more with new ports.
//
// The members are children of this process, forked by the calling thread, with
// PR_SET_PDEATHSIG=SIGKILL: they also die when that thread or this process dies without
// running the destructor. Call start()/restart() from a thread that outlives the cluster (the
// test's own). Not thread-safe: use one EtcdCluster from one thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "proc.h"
#include "skip.h"

namespace muster::testing {

struct EtcdOptions {
  int members = 3;
  std::chrono::milliseconds heartbeat{100};  // --heartbeat-interval
  std::chrono::milliseconds election{1000};  // --election-timeout (etcd wants >= 5 heartbeats)
  // The bound on start() and restart() for every member to be ready (sd_notify "READY=1").
  std::chrono::milliseconds ready{30000};
};

class EtcdCluster {
 public:
  // Why etcd cannot be run here ("no etcd on PATH (Debian's etcd-server)"), or "" when it
  // can. Tests skip when this is not empty: report_skip(why) and return (skip.h), or exit 77.
  static std::string missing();

  // Starts o.members members and returns once every one is ready, within o.ready. Throws
  // std::invalid_argument for bad options and std::runtime_error saying which member failed
  // and why, with the tail of its log (etcd's own stderr); nothing is left running then.
  static std::unique_ptr<EtcdCluster> start(EtcdOptions o = {});

  // Ends every member still running by its pid (SIGKILL: the data goes with the folder),
  // reaps it, and removes the temp folder.
  ~EtcdCluster();
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  int size() const { return static_cast<int>(members_.size()); }
  // Every member's client endpoint, "127.0.0.1:P0,127.0.0.1:P1,...", in member order (for
  // rdzvd --etcd), whether running or not.
  std::string endpoints() const;
  std::string endpoint(int i) const;  // "127.0.0.1:P"
  // The folder of the data dirs and logs, and member i's log (for a test's INFO on failure).
  const std::string& dir() const { return dir_.path(); }
  std::string log_path(int i) const;

  // Member i's pid (its last one once killed), and whether it runs now (not exited).
  pid_t pid(int i) const;
  bool running(int i) const;

  // The member that the running members report as raft leader (`etcdctl endpoint status`,
  // asked of each running member, 1 s each), or -1 when none does (an election is under way,
  // or no quorum). When two claim it (an old leader cut off), the one with the higher term.
  int leader() const;

  // kill -9 of member i by its pid; returns once it is gone (reaped). Throws
  // std::runtime_error if it is not running, or is still there after 10 s.
  void kill(int i);

  // Starts member i again (after kill) with the same name, ports and data dir
  // (--initial-cluster-state existing: it rejoins from its data). With `wait`, returns once
  // it is ready (rejoined: a quorum counts it), within the options' `ready`, and throws
  // std::runtime_error with its log if it exits or is not ready by then; without, returns at
  // once (e.g. the first of several members restarted after a quorum was lost).
  void restart(int i, bool wait = true);

  // True once every running member answers a linearizable read (`etcdctl endpoint health`,
  // which needs a quorum) within `timeout`; false when the time passes first, or no member runs.
  // A bounded poll (a pause of 50 ms after a quick failure): etcd reports readiness once at
  // start, and has no event for "a quorum answers now".
  bool healthy(std::chrono::milliseconds timeout) const;

  // Runs `etcdctl <args>` (ETCDCTL_API=3) against member `member`, or all running members when
  // -1, with a 5 s dial and command timeout, and returns its stdout. Throws std::runtime_error
  // with etcdctl's stderr when it fails. E.g. ctl({"put", "k", "v"}),
  // ctl({"get", "k", "--print-value-only"}, 2).
  std::string ctl(const std::vector<std::string>& args, int member = -1) const;

 private:
  struct Member {
    std::string name;
    int client_port = 0, peer_port = 0;
    pid_t pid = -1;
    int pidfd = -1;                // open while pid is ours and not reaped
    int notify = -1;               // the sd_notify socket (abstract, bound for the cluster's life)
    std::optional<int> exit_code;  // once reaped: the code, or 128+N for signal N
  };
  explicit EtcdCluster(EtcdOptions o);
  void start_members();
  std::string notify_name(int i) const;  // member i's abstract sd_notify socket
  void spawn(int i, bool existing);
  // Waits until each of `which` is ready (READY=1), within the options' `ready`. Throws when
  // one exits first (PortTaken, in the .cc, when it could not bind) or the time passes.
  void wait_ready(const std::vector<int>& which);
  static std::string data_base();
  void reap(int i);
  std::string running_endpoints() const;
  std::string log_tail(int i) const;

  EtcdOptions options_;
  // On tmpfs (/dev/shm) where there is one: members fsync their log on every write, and a
  // disk kept busy by another test (debootstrap, a build) would stall them for seconds, which
  // is not what these tests are about.
  TempDir dir_{data_base()};
  std::string token_;
  std::vector<Member> members_;
};

}  // namespace muster::testing
