#include "hostnet.h"

#include <fcntl.h>
#include <net/if.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "proc.h"

namespace muster::testing {

namespace {

namespace fs = std::filesystem;

struct CmdResult {
  int code = -1;  // -1: did not start or did not end in time
  std::string out, err;
};

// The absolute path of a tool: PATH first, then the sbin folders a non-login PATH may lack.
std::string find_tool(const std::string& name) {
  std::string path = std::getenv("PATH") != nullptr ? std::getenv("PATH") : "";
  path += ":/usr/sbin:/sbin:/usr/bin:/bin";
  std::istringstream in(path);
  for (std::string dir; std::getline(in, dir, ':');) {
    if (dir.empty()) continue;
    std::string p = dir + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

const std::string& tool(const char* name) {
  // Looked up once per tool; the machine's tools do not move while a test runs.
  static const std::string ip = find_tool("ip"), iptables = find_tool("iptables"),
                           ip6tables = find_tool("ip6tables"), tc = find_tool("tc"),
                           iptables_restore = find_tool("iptables-restore"),
                           ip6tables_restore = find_tool("ip6tables-restore"),
                           unshare = find_tool("unshare"), sh = find_tool("sh");
  static const std::string none;
  std::string n = name;
  if (n == "ip") return ip;
  if (n == "iptables") return iptables;
  if (n == "ip6tables") return ip6tables;
  if (n == "iptables-restore") return iptables_restore;
  if (n == "ip6tables-restore") return ip6tables_restore;
  if (n == "tc") return tc;
  if (n == "unshare") return unshare;
  if (n == "sh") return sh;
  // A tool not named here was never looked up: "" (missing), never another tool. (ip6tables
  // used to fall through to sh, so every cut also took the link down: not silent, and the
  // neighbour table flushed.)
  return none;
}

std::string join(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv) s += (s.empty() ? "" : " ") + a;
  return s;
}

CmdResult exec_cmd(const std::vector<std::string>& argv,
                   std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  CmdResult r;
  if (argv.empty() || argv[0].empty()) {
    r.err = "tool not found";
    return r;
  }
  Proc p(argv);
  auto code = p.wait(timeout);
  r.code = code.value_or(-1);
  r.out = p.out();
  r.err = p.err();
  return r;
}

// Runs a command that must succeed; the error names it and carries its stderr.
absl::Status must(const std::vector<std::string>& argv) {
  CmdResult r = exec_cmd(argv);
  if (r.code == 0) return absl::OkStatus();
  std::string why = r.code == -1 ? (r.err.empty() ? "timed out" : r.err)
                                 : "exit " + std::to_string(r.code) + ": " + trim_end(r.err);
  return absl::InternalError("`" + join(argv) + "` failed (" + why + ")");
}

bool ok(const std::vector<std::string>& argv) { return exec_cmd(argv).code == 0; }

std::vector<std::string> in_ns(const std::string& ns, std::vector<std::string> argv) {
  std::vector<std::string> v{tool("ip"), "netns", "exec", ns};
  v.insert(v.end(), argv.begin(), argv.end());
  return v;
}

bool iptables_works(const std::string& ns, const char* which = "iptables") {
  return !tool(which).empty() && ok(in_ns(ns, {tool(which), "-w", "-S"}));
}

// iptables rule specs; the chain comes first.
absl::Status add_rule(const std::string& ns, std::vector<std::string> spec,
                      const char* which = "iptables") {
  auto check = in_ns(ns, {tool(which), "-w", "-C"});
  check.insert(check.end(), spec.begin(), spec.end());
  if (ok(check)) return absl::OkStatus();
  auto ins = in_ns(ns, {tool(which), "-w", "-I"});
  ins.insert(ins.end(), spec.begin(), spec.end());
  return must(ins);
}

absl::Status remove_rule(const std::string& ns, std::vector<std::string> spec,
                         const char* which = "iptables") {
  auto check = in_ns(ns, {tool(which), "-w", "-C"});
  check.insert(check.end(), spec.begin(), spec.end());
  auto del = in_ns(ns, {tool(which), "-w", "-D"});
  del.insert(del.end(), spec.begin(), spec.end());
  for (int guard = 0; guard < 16 && ok(check); ++guard) {
    if (auto s = must(del); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// The root-namespace end of the namespace's eth0: "2: eth0@if7: ..." names its ifindex.
absl::StatusOr<std::string> bridge_side(const std::string& ns) {
  CmdResult r = exec_cmd({tool("ip"), "-n", ns, "-o", "link", "show", "dev", "eth0"});
  if (r.code != 0) return absl::NotFoundError("no eth0 in namespace " + ns + ": " + trim_end(r.err));
  auto at = r.out.find("@if");
  if (at == std::string::npos) return absl::NotFoundError("eth0 of " + ns + " is no veth");
  unsigned idx = static_cast<unsigned>(std::atoi(r.out.c_str() + at + 3));
  char name[IF_NAMESIZE];
  if (idx == 0 || ::if_indextoname(idx, name) == nullptr)
    return absl::NotFoundError("the peer of " + ns + "'s eth0 is not in this namespace");
  return std::string(name);
}

bool has_tbf(const std::vector<std::string>& show) {
  return exec_cmd(show).out.find("tbf") != std::string::npos;
}

absl::Status write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError("cannot write " + path);
  return absl::OkStatus();
}

// Holds an flock on a machine-wide file while a /24 and names are picked and taken.
class MachineLock {
 public:
  MachineLock() {
    const char* dir = ::access("/run/lock", W_OK) == 0 ? "/run/lock" : "/tmp";
    fd_ = ::open((std::string(dir) + "/muster-hostnet.lock").c_str(),
                 O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd_ >= 0) ::flock(fd_, LOCK_EX);
  }
  ~MachineLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
  }
  MachineLock(const MachineLock&) = delete;
  MachineLock& operator=(const MachineLock&) = delete;

 private:
  int fd_ = -1;
};

std::string prefix_of(int k) {
  return k < 256 ? "198.18." + std::to_string(k) : "198.19." + std::to_string(k - 256);
}

std::atomic<int> g_instances{0};  // makes names unique within a process

}  // namespace

absl::StatusOr<std::unique_ptr<HostNet>> HostNet::create(int n) {
  if (n < 1 || n > 200) return absl::InvalidArgumentError("HostNet: n must be in 1..200");
  if (::geteuid() != 0) return absl::PermissionDeniedError("HostNet: needs root (euid is not 0)");
  for (const char* t : {"ip", "unshare", "sh"}) {
    if (tool(t).empty())
      return absl::FailedPreconditionError(std::string("HostNet: no `") + t + "` in PATH");
  }
  std::unique_ptr<HostNet> net(new HostNet());
  if (auto s = net->build(n); !s.ok()) return s;  // ~HostNet removes what was made
  return net;
}

absl::Status HostNet::build(int n) {
  {
    MachineLock lock;
    int counter = g_instances.fetch_add(1);
    CmdResult addrs = exec_cmd({tool("ip"), "-o", "-4", "addr", "show"});
    if (addrs.code != 0)
      return absl::FailedPreconditionError("HostNet: `ip -o -4 addr show` failed: " + addrs.err);
    CmdResult routes = exec_cmd({tool("ip"), "-4", "route", "show", "table", "all"});
    std::string seen = "\n" + addrs.out + routes.out;
    int pid = static_cast<int>(::getpid());
    for (int attempt = 0; attempt < 100 && tag_.empty(); ++attempt) {
      std::string tag = std::to_string(pid % 100000) + "_" + std::to_string((counter + attempt) % 100);
      if (::if_nametoindex(("mb" + tag).c_str()) != 0) continue;
      if (fs::exists("/run/netns/mn" + tag + "_0")) continue;
      tag_ = tag;
    }
    if (tag_.empty()) return absl::ResourceExhaustedError("HostNet: no free instance name");
    int k0 = (pid * 131 + counter * 17) % 512;
    for (int a = 0; a < 512 && prefix_.empty(); ++a) {
      std::string p = prefix_of((k0 + a) % 512);
      if (seen.find(" " + p + ".") == std::string::npos &&
          seen.find("\n" + p + ".") == std::string::npos)
        prefix_ = p;
    }
    if (prefix_.empty())
      return absl::ResourceExhaustedError("HostNet: every /24 of 198.18.0.0/15 is in use");
    {
      // The same index for the IPv6 /64: 198.18.k / 198.19.(k-256) -> 2001:db8:<k hex>.
      const std::string third = prefix_.substr(prefix_.rfind('.') + 1);
      const int k = std::stoi(third) + (prefix_.rfind("198.19.", 0) == 0 ? 256 : 0);
      char buf[32];
      std::snprintf(buf, sizeof buf, "2001:db8:%x", k + 1);
      prefix6_ = buf;
    }
    bridge_ = "mb" + tag_;
    if (auto s = must({tool("ip"), "link", "add", bridge_, "type", "bridge"}); !s.ok()) {
      return absl::PermissionDeniedError("HostNet: cannot make a bridge (needs CAP_NET_ADMIN): " +
                                         std::string(s.message()));
    }
    bridge_made_ = true;
    if (auto s = must({tool("ip"), "addr", "add", gateway() + "/24", "dev", bridge_}); !s.ok())
      return s;
  }
  if (auto s = must({tool("ip"), "link", "set", "dev", bridge_, "up"}); !s.ok()) return s;
  // Where bridged frames go through the root's iptables (br_netfilter), a FORWARD policy of
  // DROP (docker sets one) would cut the hosts apart: let this bridge's frames through.
  if (trim_end(read_file("/proc/sys/net/bridge/bridge-nf-call-iptables")) == "1" &&
      !tool("iptables").empty()) {
    forward_rule_ = ok({tool("iptables"), "-w", "-I", "FORWARD", "-i", bridge_, "-o", bridge_,
                        "-j", "ACCEPT"});
  }

  std::string hosts_file = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n";
  for (int i = 0; i < n; ++i) hosts_file += addr(i) + "\tnode" + std::to_string(i) + "\n";
  for (int i = 0; i < n; ++i) hosts_file += addr6(i) + "\tnode" + std::to_string(i) + "-v6\n";

  for (int i = 0; i < n; ++i) {
    hosts_.push_back({"mn" + tag_ + "_" + std::to_string(i), "mv" + tag_ + "_" + std::to_string(i)});
    Host& h = hosts_.back();
    std::string host = hostname(i);
    if (auto s = must({tool("ip"), "netns", "add", h.ns}); !s.ok()) return s;
    h.ns_made = true;
    if (auto s = must({tool("ip"), "link", "add", h.veth, "type", "veth", "peer", "name", "eth0",
                       "netns", h.ns});
        !s.ok())
      return s;
    h.veth_made = true;
    for (const auto& cmd : std::vector<std::vector<std::string>>{
             {tool("ip"), "link", "set", "dev", h.veth, "master", bridge_, "up"},
             {tool("ip"), "-n", h.ns, "addr", "add", addr(i) + "/24", "dev", "eth0"},
             {tool("ip"), "-n", h.ns, "-6", "addr", "add", addr6(i) + "/64", "dev", "eth0",
              "nodad"},
             {tool("ip"), "-n", h.ns, "link", "set", "dev", "eth0", "up"},
             {tool("ip"), "-n", h.ns, "link", "set", "dev", "lo", "up"}}) {
      if (auto s = must(cmd); !s.ok()) return s;
    }
    std::string etc = "/etc/netns/" + h.ns;
    std::error_code ec;
    fs::create_directories(etc, ec);
    if (ec) return absl::InternalError("HostNet: cannot make " + etc + ": " + ec.message());
    h.etc_made = true;
    if (auto s = write_file(etc + "/hosts", hosts_file); !s.ok()) return s;
    if (auto s = write_file(etc + "/hostname", host + "\n"); !s.ok()) return s;
  }
  return absl::OkStatus();
}

HostNet::~HostNet() {
  // The bridge-side veth first: deleting it deletes its peer even while processes keep the
  // namespace alive after `ip netns del`.
  for (const Host& h : hosts_) {
    if (h.veth_made) exec_cmd({tool("ip"), "link", "del", "dev", h.veth});
    if (h.ns_made) exec_cmd({tool("ip"), "netns", "del", h.ns});
    if (h.etc_made) {
      std::error_code ec;
      fs::remove_all("/etc/netns/" + h.ns, ec);
    }
  }
  if (forward_rule_) {
    exec_cmd({tool("iptables"), "-w", "-D", "FORWARD", "-i", bridge_, "-o", bridge_, "-j",
              "ACCEPT"});
  }
  if (bridge_made_) exec_cmd({tool("ip"), "link", "del", "dev", bridge_});
}

std::string HostNet::addr(int i) const { return prefix_ + "." + std::to_string(i + 1); }
std::string HostNet::addr6(int i) const {
  char buf[16];
  std::snprintf(buf, sizeof buf, "::%x", i + 1);
  return prefix6_ + buf;
}
std::string HostNet::hostname(int i) const { return "node" + std::to_string(i); }
std::string HostNet::ns(int i) const { return hosts_.at(static_cast<std::size_t>(i)).ns; }
std::string HostNet::gateway() const { return prefix_ + ".254"; }
std::string HostNet::unused_addr() const { return prefix_ + ".253"; }

absl::Status HostNet::check(int i) const {
  if (i < 0 || i >= size())
    return absl::OutOfRangeError("HostNet: no host " + std::to_string(i));
  return absl::OkStatus();
}

std::vector<std::string> HostNet::wrap(int i, const std::vector<std::string>& argv) const {
  return wrap_ns(ns(i), hostname(i), argv);
}

int HostNet::run(int i, const std::vector<std::string>& argv,
                 std::chrono::milliseconds timeout) const {
  Proc p(wrap(i, argv));
  return p.wait(timeout).value_or(-1);  // ~Proc kills it when it is still running
}

absl::Status HostNet::cut(int i) {
  if (auto s = check(i); !s.ok()) return s;
  return cut_ns(ns(i));
}
absl::Status HostNet::heal(int i) {
  if (auto s = check(i); !s.ok()) return s;
  return heal_ns(ns(i));
}
absl::Status HostNet::cut_between(int i, int j) {
  if (auto s = check(i); !s.ok()) return s;
  if (auto s = check(j); !s.ok()) return s;
  return cut_between_ns(ns(i), addr(j));
}
absl::Status HostNet::heal_between(int i, int j) {
  if (auto s = check(i); !s.ok()) return s;
  if (auto s = check(j); !s.ok()) return s;
  return heal_between_ns(ns(i), addr(j));
}
absl::Status HostNet::rate_limit(int i, int kbit) {
  if (auto s = check(i); !s.ok()) return s;
  return rate_limit_ns(ns(i), kbit);
}
absl::Status HostNet::clear_limits(int i) {
  if (auto s = check(i); !s.ok()) return s;
  return clear_limits_ns(ns(i));
}

absl::Status HostNet::set_resolver(int i, const std::string& nameserver) {
  if (auto s = check(i); !s.ok()) return s;
  return write_file("/etc/netns/" + ns(i) + "/resolv.conf",
                    "nameserver " + nameserver + "\n");
}

// The cut's two rules of one family (`op`: -I to cut, -D to heal) as one iptables-restore
// transaction: both directions go at one instant, in one command, so a blip is as long as the
// caller's wait between cut and heal, not that plus a dozen iptables runs, each waiting on the
// xtables lock that every namespace shares (the gap between the first rule and the last one
// was 50 ms idle and more under load).
namespace {
absl::Status cut_rules(const std::string& ns, const char* op, const char* which) {
  const std::string restore = std::string(which) + "-restore";
  if (tool(restore.c_str()).empty()) return absl::FailedPreconditionError("no " + restore);
  static std::atomic<int> seq{0};
  const std::string file = "/tmp/muster-hostnet-" + std::to_string(::getpid()) + "-" +
                           std::to_string(seq++) + ".rules";
  const std::string rules = std::string("*filter\n") + op + " INPUT -i eth0 -j DROP\n" + op +
                            " OUTPUT -o eth0 -j DROP\nCOMMIT\n";
  if (auto s = write_file(file, rules); !s.ok()) return s;
  absl::Status s = must(in_ns(ns, {tool(restore.c_str()), "-w", "--noflush", file}));
  std::error_code ec;
  fs::remove(file, ec);
  return s;
}
}  // namespace

absl::Status cut_ns(const std::string& ns) {
  // The common case first, so the cut takes effect at once: one transaction per family
  // (IPv4, then IPv6, as heal_ns does; every host has an address of each family).
  if (cut_rules(ns, "-I", "iptables").ok()) {
    if (cut_rules(ns, "-I", "ip6tables").ok()) return absl::OkStatus();
  }
  if (iptables_works(ns)) {
    if (auto s = add_rule(ns, {"INPUT", "-i", "eth0", "-j", "DROP"}); !s.ok()) return s;
    if (auto s = add_rule(ns, {"OUTPUT", "-o", "eth0", "-j", "DROP"}); !s.ok()) return s;
    // IPv6 too, where ip6tables works; else the link goes down below as well.
    if (iptables_works(ns, "ip6tables")) {
      if (auto s = add_rule(ns, {"INPUT", "-i", "eth0", "-j", "DROP"}, "ip6tables"); !s.ok())
        return s;
      return add_rule(ns, {"OUTPUT", "-o", "eth0", "-j", "DROP"}, "ip6tables");
    }
  }
  // No iptables: the link goes down (the host's own sends then fail at once, the peers'
  // packets are still dropped silently).
  auto veth = bridge_side(ns);
  if (!veth.ok()) return veth.status();
  return must({tool("ip"), "link", "set", "dev", *veth, "down"});
}

absl::Status heal_ns(const std::string& ns) {
  // The heal takes effect with the first transaction of each family (as the cut did); what
  // follows only clears what a cut made twice, or a fallback cut, after the path is back.
  (void)cut_rules(ns, "-D", "iptables");
  (void)cut_rules(ns, "-D", "ip6tables");
  if (iptables_works(ns)) {
    if (auto s = remove_rule(ns, {"INPUT", "-i", "eth0", "-j", "DROP"}); !s.ok()) return s;
    if (auto s = remove_rule(ns, {"OUTPUT", "-o", "eth0", "-j", "DROP"}); !s.ok()) return s;
    if (iptables_works(ns, "ip6tables")) {
      if (auto s = remove_rule(ns, {"INPUT", "-i", "eth0", "-j", "DROP"}, "ip6tables"); !s.ok())
        return s;
      if (auto s = remove_rule(ns, {"OUTPUT", "-o", "eth0", "-j", "DROP"}, "ip6tables"); !s.ok())
        return s;
    }
  }
  auto veth = bridge_side(ns);
  if (!veth.ok()) return veth.status();
  return must({tool("ip"), "link", "set", "dev", *veth, "up"});
}

absl::Status cut_between_ns(const std::string& ns, const std::string& peer_addr) {
  if (!iptables_works(ns))
    return absl::UnimplementedError("cut_between: iptables does not work in " + ns);
  const char* which = peer_addr.find(':') != std::string::npos ? "ip6tables" : "iptables";
  if (auto s = add_rule(ns, {"INPUT", "-i", "eth0", "-s", peer_addr, "-j", "DROP"}, which);
      !s.ok())
    return s;
  return add_rule(ns, {"OUTPUT", "-o", "eth0", "-d", peer_addr, "-j", "DROP"}, which);
}

absl::Status heal_between_ns(const std::string& ns, const std::string& peer_addr) {
  if (!iptables_works(ns))
    return absl::UnimplementedError("heal_between: iptables does not work in " + ns);
  const char* which = peer_addr.find(':') != std::string::npos ? "ip6tables" : "iptables";
  if (auto s = remove_rule(ns, {"INPUT", "-i", "eth0", "-s", peer_addr, "-j", "DROP"}, which);
      !s.ok())
    return s;
  return remove_rule(ns, {"OUTPUT", "-o", "eth0", "-d", peer_addr, "-j", "DROP"}, which);
}

absl::Status rate_limit_ns(const std::string& ns, int kbit) {
  if (kbit <= 0) return absl::InvalidArgumentError("rate_limit: kbit must be positive");
  if (tool("tc").empty()) return absl::FailedPreconditionError("rate_limit: no `tc` in PATH");
  auto veth = bridge_side(ns);
  if (!veth.ok()) return veth.status();
  // burst: 20 ms at the rate, at least a few full frames (tbf needs burst > MTU).
  long burst = std::max<long>(4500, static_cast<long>(kbit) * 1000 / 8 / 50);
  std::vector<std::string> tbf{"root", "tbf", "rate", std::to_string(kbit) + "kbit", "burst",
                               std::to_string(burst), "latency", "400ms"};
  std::vector<std::string> in{tool("tc"), "-n", ns, "qdisc", "replace", "dev", "eth0"};
  std::vector<std::string> out{tool("tc"), "qdisc", "replace", "dev", *veth};
  in.insert(in.end(), tbf.begin(), tbf.end());
  out.insert(out.end(), tbf.begin(), tbf.end());
  if (auto s = must(in); !s.ok()) return s;
  return must(out);
}

absl::Status clear_limits_ns(const std::string& ns) {
  if (tool("tc").empty()) return absl::FailedPreconditionError("clear_limits: no `tc` in PATH");
  auto veth = bridge_side(ns);
  if (!veth.ok()) return veth.status();
  if (has_tbf({tool("tc"), "-n", ns, "qdisc", "show", "dev", "eth0"})) {
    if (auto s = must({tool("tc"), "-n", ns, "qdisc", "del", "dev", "eth0", "root"}); !s.ok())
      return s;
  }
  if (has_tbf({tool("tc"), "qdisc", "show", "dev", *veth}))
    return must({tool("tc"), "qdisc", "del", "dev", *veth, "root"});
  return absl::OkStatus();
}

std::vector<std::string> wrap_ns(const std::string& ns, const std::string& host,
                                 const std::vector<std::string>& argv) {
  // sh's $0 carries the hostname; printf is a builtin and `exec` replaces sh: no fork anywhere.
  std::vector<std::string> v{tool("ip"),   "netns", "exec", ns,   tool("unshare"), "--uts", "--",
                             tool("sh"),   "-c",
                             "printf %s \"$0\" >/proc/sys/kernel/hostname && exec \"$@\"", host};
  v.insert(v.end(), argv.begin(), argv.end());
  return v;
}

std::vector<pid_t> ns_pids(const std::string& ns) {
  std::vector<pid_t> pids;
  std::istringstream in(exec_cmd({tool("ip"), "netns", "pids", ns}).out);
  for (long p; in >> p;) pids.push_back(static_cast<pid_t>(p));
  return pids;
}

}  // namespace muster::testing
