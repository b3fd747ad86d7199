// Multi-host tests on one machine: each "host" is a network namespace with a veth pair to one
// Linux bridge in the root namespace, addresses in 198.18.0.0/15 (RFC 2544, reserved for
// benchmarking; never routed), no default route (a host reaches only its peers and the bridge).
//
//   bridge  mb<tag>          <prefix>.254/24  (the test process, in the root namespace)
//   host i  namespace mn<tag>_<i>, eth0 <prefix>.<i+1>/24, lo up, hostname node<i>,
//           /etc/netns/<ns>/hosts naming every host (ip netns exec bind-mounts it on /etc/hosts)
//
// <tag> is <pid % 100000>_<counter>; the /24 is derived from the pid and a counter and chosen,
// under a lock file, so that no interface of the machine already has an address in it: tests
// may run in parallel. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), `ip` and, for cut(), `iptables`;
// `tc` for rate limits. create() says why when it cannot; callers then skip.
//
// Faults: cut()/cut_between() drop packets with iptables rules inside a host's namespace (no FIN,
// no RST: the peers see silence; the cut host's own datagram sends fail with EPERM). cut() and
// heal() each take effect at one instant per address family (one iptables-restore transaction
// for both directions), so a blip is as long as the caller waits between the two. Without a
// working iptables cut() falls back to taking the bridge-side veth down and cut_between() is
// unavailable. rate_limit() is tbf on both ends of the host's veth. There is no netem on the
// machines this was written on: for delay use fault_proxy (tests/support/fault_proxy.cc).
//
// Every external command is fork+exec'd (no shell on our side); errors name the command that
// failed and its stderr. Not thread-safe: use one HostNet from one thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace muster::testing {

class HostNet {
 public:
  // Makes n hosts (1 <= n <= 200). On failure everything made so far is removed again.
  static absl::StatusOr<std::unique_ptr<HostNet>> create(int n);

  // Removes the bridge, veths, namespaces (their iptables rules and qdiscs go with them) and
  // /etc/netns/<ns> folders this instance made, and nothing else. Processes still running in
  // a host are not killed (end them by pid first, e.g. through Proc); they lose their network.
  ~HostNet();
  HostNet(const HostNet&) = delete;
  HostNet& operator=(const HostNet&) = delete;

  int size() const { return static_cast<int>(hosts_.size()); }
  std::string addr(int i) const;      // "198.18.x.<i+1>"
  // Host i's IPv6 address, "2001:db8:<x>::<i+1>" (RFC 3849, documentation), no DAD wait; its
  // name in every host's /etc/hosts is hostname(i) + "-v6" (hostname(i) is IPv4 only).
  std::string addr6(int i) const;
  std::string hostname(int i) const;  // "node<i>"
  std::string ns(int i) const;        // the network namespace's name (ip netns list)
  std::string gateway() const;        // the bridge's address, "198.18.x.254"
  std::string bridge() const { return bridge_; }
  // An address in this instance's /24 that nobody has: connections to it get no answer
  // (ARP fails), e.g. for set_resolver() with a dead DNS server.
  std::string unused_addr() const;

  // An argv that runs `argv` inside host i with its own UTS namespace (hostname node<i>):
  //   ip netns exec NS unshare --uts -- sh -c 'echo "$0" >/proc/sys/kernel/hostname &&
  //   exec "$@"' node<i> ARGV...
  // Every layer execs, none forks: the pid of the process started with it is the pid of
  // argv[0]'s program, so a test can signal it and read its exit status. argv[0] is looked up
  // in PATH. The result starts with an absolute path (usable with execve, e.g. Proc).
  std::vector<std::string> wrap(int i, const std::vector<std::string>& argv) const;

  // Runs argv in host i (wrapped as above) and returns its exit code (128+N when killed by
  // signal N), or -1 when it did not end within `timeout` (it is then killed). For setup steps.
  int run(int i, const std::vector<std::string>& argv,
          std::chrono::milliseconds timeout = std::chrono::seconds(60)) const;

  // Silent partition of host i from every other host and from the bridge (idempotent).
  absl::Status cut(int i);
  absl::Status heal(int i);
  // Drops only the traffic between hosts i and j (both directions), in host i's namespace.
  // Unimplemented without a working iptables. heal_between(i, j) undoes cut_between(i, j).
  absl::Status cut_between(int i, int j);
  absl::Status heal_between(int i, int j);

  // tbf at `kbit` kilobits/s on host i's veth, both directions; clear_limits removes it.
  absl::Status rate_limit(int i, int kbit);
  absl::Status clear_limits(int i);

  // Writes /etc/netns/<ns>/resolv.conf: processes started in host i after this (through wrap)
  // use `nameserver`, with the resolver's default timeouts (5 s, 2 attempts), as a real host.
  absl::Status set_resolver(int i, const std::string& nameserver);

 private:
  struct Host {
    std::string ns, veth;  // veth: the bridge-side end; the namespace side is eth0
    bool ns_made = false, veth_made = false, etc_made = false;
  };
  HostNet() = default;
  absl::Status build(int n);
  absl::Status check(int i) const;

  std::string prefix_;  // "198.18.x"
  std::string prefix6_;  // "2001:db8:<x>"
  std::string tag_;
  std::string bridge_;
  bool bridge_made_ = false;
  bool forward_rule_ = false;  // an ACCEPT in the root FORWARD chain (br_netfilter machines)
  std::vector<Host> hosts_;
};

// The same faults by namespace name, for the hostnet CLI (which runs apart from the HostNet
// object). All idempotent. The bridge-side veth is found through eth0's peer ifindex.
absl::Status cut_ns(const std::string& ns);
absl::Status heal_ns(const std::string& ns);
absl::Status cut_between_ns(const std::string& ns, const std::string& peer_addr);
absl::Status heal_between_ns(const std::string& ns, const std::string& peer_addr);
absl::Status rate_limit_ns(const std::string& ns, int kbit);
absl::Status clear_limits_ns(const std::string& ns);

// The argv that runs `argv` in namespace `ns` with hostname `host` (see HostNet::wrap).
std::vector<std::string> wrap_ns(const std::string& ns, const std::string& host,
                                 const std::vector<std::string>& argv);

// The pids of every process in namespace `ns` (ip netns pids).
std::vector<pid_t> ns_pids(const std::string& ns);

}  // namespace muster::testing
