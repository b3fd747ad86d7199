#include "muster/launcher/hostfile.h"

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/state_machine.h"

using muster::launcher::HostSlots;
using muster::launcher::parse_host_list;
using muster::launcher::parse_hostfile;
using muster::launcher::select_hosts;

namespace {

// "host:slots" per entry, for one readable comparison.
std::vector<std::string> flat(const std::vector<HostSlots>& hs) {
  std::vector<std::string> out;
  for (const auto& h : hs) out.push_back(h.host + "=" + std::to_string(h.slots));
  return out;
}

using Strings = std::vector<std::string>;

Strings list_ok(std::string_view text) {
  auto r = parse_host_list(text);
  INFO(text << " -> " << r.status().message());
  REQUIRE(r.ok());
  return flat(*r);
}

std::string list_err(std::string_view text) {
  auto r = parse_host_list(text);
  INFO(text);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(r.status().message());
}

Strings file_ok(std::string_view text) {
  auto r = parse_hostfile(text, "hosts.txt");
  INFO(text << " -> " << r.status().message());
  REQUIRE(r.ok());
  return flat(*r);
}

std::string file_err(std::string_view text) {
  auto r = parse_hostfile(text, "hosts.txt");
  INFO(text);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(r.status().message());
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

const std::vector<HostSlots> kFour{{"a", 2}, {"b", 0}, {"alice@c", 4}, {"fd00::1", 1}};

Strings select_ok(std::string_view include, std::string_view exclude) {
  auto r = select_hosts(kFour, include, exclude);
  INFO(include << " / " << exclude << " -> " << r.status().message());
  REQUIRE(r.ok());
  return flat(*r);
}

std::string select_err(std::string_view include, std::string_view exclude) {
  auto r = select_hosts(kFour, include, exclude);
  INFO(include << " / " << exclude);
  REQUIRE_FALSE(r.ok());
  return std::string(r.status().message());
}

}  // namespace

TEST_CASE("host list (--hosts): horovod's h1:8,h2:8,h3") {
  CHECK(list_ok("h1:8,h2:8,h3") == Strings{"h1=8", "h2=8", "h3=0"});
  CHECK(list_ok("h1") == Strings{"h1=0"});
  CHECK(has(list_err(" h1 : 2 "), "'h1 ' is not a host name"));  // no space inside an item
  CHECK(list_ok("  h1:2 ,\th2 ") == Strings{"h1=2", "h2=0"});
  CHECK(list_ok("node-1.example.com:3,10.0.0.7:1,my_host") ==
        Strings{"node-1.example.com=3", "10.0.0.7=1", "my_host=0"});
  CHECK(list_ok("alice@h1:4,bob@h2") == Strings{"alice@h1=4", "bob@h2=0"});
}

TEST_CASE("host list (--hosts): IPv6 in brackets with slots, bare without") {
  CHECK(list_ok("[fd00::1]:4,fd00::2,[fd00::3]") == Strings{"fd00::1=4", "fd00::2=0", "fd00::3=0"});
  CHECK(list_ok("alice@[fd00::1]:2") == Strings{"alice@fd00::1=2"});
  CHECK(list_ok("fe80::1%eth0") == Strings{"fe80::1%eth0=0"});
  // A bare item with two ':' is the address, never address:slots.
  CHECK(list_ok("fd00::1:4") == Strings{"fd00::1:4=0"});
  CHECK(has(list_err("[fd00::1"), "no closing ']'"));
  CHECK(has(list_err("[fd00::1]4"), "only ':SLOTS' may follow ']'"));
  CHECK(has(list_err("[node1]:4"), "is not one"));
  CHECK(has(list_err("fd00::zz"), "neither a host name nor an IPv6 address"));
  CHECK(has(list_err("[fd00::1%e;th0]"), "is not one"));
}

TEST_CASE("host list (--hosts): slots are 1..kMaxLocalWorldSize") {
  const int max = muster::rendezvous::kMaxLocalWorldSize;
  CHECK(list_ok("h:1") == Strings{"h=1"});
  CHECK(list_ok("h:" + std::to_string(max)) == Strings{"h=" + std::to_string(max)});
  const std::string range = "is not in 1.." + std::to_string(max);
  CHECK(has(list_err("h:" + std::to_string(max + 1)), range));
  for (const char* bad : {"h:0", "h:-1", "h:+2", "h:", "h:2x", "h:1.5", "h:99999999999999"}) {
    INFO(bad);
    CHECK(has(list_err(bad), range));
  }
  CHECK(has(list_err("h1:2,h2:0"), "--hosts: item 2: slots '0'"));
}

TEST_CASE("host list (--hosts): empty lists and items, duplicates") {
  CHECK(list_err("") == "--hosts: no host given");
  CHECK(list_err("  ") == "--hosts: no host given");
  CHECK(has(list_err("h1,,h2"), "--hosts: item 2: empty"));
  CHECK(has(list_err("h1,"), "--hosts: item 2: empty"));
  CHECK(has(list_err(",h1"), "--hosts: item 1: empty"));
  CHECK(list_err("h1,h2,h1:4") == "--hosts: host h1 is listed twice (first as item 1)");
  // The same host however it is spelt: case, user@, IPv6 forms.
  CHECK(has(list_err("Node1,node1"), "is listed twice"));
  CHECK(has(list_err("alice@node1,bob@node1"), "is listed twice"));
  CHECK(has(list_err("fd00::1,[fd00:0:0::1]:2"), "is listed twice"));
}

TEST_CASE("host list (--hosts): a host must be safe on an ssh command line") {
  for (const char* bad :
       {"h;rm -rf /", "h|x", "h&x", "$(x)", "`x`", "h'x", "h\"x", "h\\x", "h<x", "h>x", "h x",
        "h\tx:2", "h*", "h/x", "-oProxyCommand=x", "alice@-oX", "-x@h", "h\x01"}) {
    INFO(bad);
    CHECK_FALSE(parse_host_list(bad).ok());
  }
  CHECK(has(list_err("h;x"), "'h;x' is not a host name"));
  CHECK(has(list_err("-oProxyCommand=x"), "not starting with '-'"));
  CHECK(has(list_err("@h"), "empty user before '@'"));
  CHECK(has(list_err("alice@"), "empty host after '@'"));
  CHECK(has(list_err("al ice@h"), "user name may hold only"));
  CHECK(has(list_err("a@b@c"), "is not a host name"));
  CHECK(has(list_err("h\x01"), "'h\\x01'"));  // shown, not sent raw to a terminal
  const std::string longest(muster::rendezvous::limits::kMaxIdBytes, 'a');
  CHECK(list_ok(longest) == Strings{longest + "=0"});
  CHECK(has(list_err(longest + "a"), "longer than the limit"));
}

TEST_CASE("host list (--hosts): at most kMaxHosts hosts") {
  const std::size_t max = muster::rendezvous::limits::kMaxHosts;
  std::string text;
  for (std::size_t i = 0; i < max; ++i) text += (i ? ",h" : "h") + std::to_string(i);
  auto r = parse_host_list(text);
  REQUIRE(r.ok());
  CHECK(r->size() == max);
  CHECK(has(list_err(text + ",one_more"), "more than " + std::to_string(max) + " hosts"));
}

TEST_CASE("hostfile: DeepSpeed's slots=N, OpenMPI's max_slots, horovod's host:N, bare") {
  CHECK(file_ok("worker-1 slots=8\n"
                "worker-2 slots=4 max_slots=8\n"
                "worker-3:2\n"
                "worker-4\n"
                "[fd00::1]:3\n"
                "fd00::2 slots=5\n"
                "alice@worker-5 slots=1") == Strings{"worker-1=8", "worker-2=4", "worker-3=2",
                                                     "worker-4=0", "fd00::1=3", "fd00::2=5",
                                                     "alice@worker-5=1"});
  // Fields split on any whitespace; CRLF line ends; no newline at the end.
  CHECK(file_ok("  a \t slots=2  \r\nb\r\n") == Strings{"a=2", "b=0"});
  CHECK(file_ok("a max_slots=4") == Strings{"a=0"});  // max_slots alone: ignored
}

TEST_CASE("hostfile: comments and blank lines") {
  CHECK(file_ok("# the cluster\n"
                "\n"
                "a slots=2   # the first\n"
                "   \t\n"
                "  # indented comment\n"
                "b:3# no space before it\n"
                "c #slots=9 is a comment\n") == Strings{"a=2", "b=3", "c=0"});
}

TEST_CASE("hostfile: errors name the source and the line") {
  CHECK(file_err("") == "hosts.txt: no host in the hostfile");
  CHECK(file_err("# nothing\n\n") == "hosts.txt: no host in the hostfile");
  CHECK(has(file_err("a\nb\nc slots=0\n"), "hosts.txt:3: slots='0' is not in 1.."));
  CHECK(has(file_err("a\n\nc:x\n"), "hosts.txt:3: slots 'x' is not in 1.."));
  CHECK(has(file_err("a slots=2\nb slots=3 max_slots=x\n"), "hosts.txt:2: max_slots='x'"));
  CHECK(has(file_err("a slots=2 slots=3"), "hosts.txt:1: slots given twice for a"));
  CHECK(has(file_err("a:2 slots=3"), "hosts.txt:1: slots given twice for a"));
  CHECK(has(file_err("a max_slots=2 max_slots=3"), "hosts.txt:1: max_slots given twice"));
  CHECK(has(file_err("a\nb slots 4\n"), "hosts.txt:2: 'slots' is not understood"));
  CHECK(has(file_err("a\nb gpus=4\n"), "hosts.txt:2: 'gpus=4' is not understood"));
  CHECK(has(file_err("a\nb;reboot slots=1\n"), "hosts.txt:2: 'b;reboot' is not a host name"));
  CHECK(has(file_err("a\n$(id)\n"), "hosts.txt:2: "));
  CHECK(file_err("a slots=1\nb\n# c\nA slots=2\n") ==
        "hosts.txt:4: host A is listed twice (first on line 1)");
  auto other = parse_hostfile("x\nx\n", "/etc/muster/cluster");
  REQUIRE_FALSE(other.ok());
  CHECK(
      has(std::string(other.status().message()), "/etc/muster/cluster:2: host x is listed twice"));
}

TEST_CASE("hostfile: at most kMaxHosts hosts") {
  const std::size_t max = muster::rendezvous::limits::kMaxHosts;
  std::string text;
  for (std::size_t i = 0; i < max; ++i) text += "h" + std::to_string(i) + " slots=1\n";
  auto r = parse_hostfile(text, "big");
  REQUIRE(r.ok());
  CHECK(r->size() == max);
  CHECK(has(file_err(text + "one_more\n"),
            "hosts.txt:" + std::to_string(max + 1) + ": more than " + std::to_string(max)));
}

TEST_CASE("select_hosts: neither, --include, --exclude, the order of the list is kept") {
  CHECK(select_ok("", "") == flat(kFour));
  CHECK(select_ok("  ", "") == flat(kFour));
  CHECK(select_ok("b,a", "") == Strings{"a=2", "b=0"});
  CHECK(select_ok("b@a", "") == Strings{"a=2", "b=0"});  // DeepSpeed's '@'
  CHECK(select_ok("", "a,c") == Strings{"b=0", "fd00::1=1"});
  CHECK(select_ok("", "fd00::1@b") == Strings{"a=2", "alice@c=4"});
  CHECK(select_ok(" a , a ", "") == Strings{"a=2"});
}

TEST_CASE("select_hosts: names match as duplicates do") {
  CHECK(select_ok("A", "") == Strings{"a=2"});              // case
  CHECK(select_ok("c", "") == Strings{"alice@c=4"});        // without the user@
  CHECK(select_ok("alice@c", "") == Strings{"alice@c=4"});  // whole, not split at its '@'
  CHECK(select_ok("[fd00::1]", "") == Strings{"fd00::1=1"});
  CHECK(select_ok("fd00:0::1", "") == Strings{"fd00::1=1"});  // another spelling
}

TEST_CASE("select_hosts: errors") {
  CHECK(select_err("a", "b") == "--include and --exclude cannot both be given");
  CHECK(select_err("a,zed", "") == "--include: host zed is not in the host list");
  CHECK(select_err("", "zed") == "--exclude: host zed is not in the host list");
  CHECK(select_err("bob@c", "") == "--include: host bob is not in the host list");
  CHECK(has(select_err("a,,b", ""), "--include: an empty name"));
  CHECK(has(select_err("a@", ""), "--include: an empty name in 'a@'"));
  const std::string gpu = select_err("a:0,1", "");
  CHECK(has(gpu, "'a:0' selects GPUs of a host"));
  CHECK(has(gpu, "not supported"));
  CHECK(has(gpu, "CUDA_VISIBLE_DEVICES"));
  CHECK(has(select_err("", "b:1"), "--exclude: 'b:1' selects GPUs"));
  CHECK(has(select_err("[fd00::1]:0", ""), "selects GPUs"));
  // An unknown bare IPv6 address is an unknown host, not a GPU selection.
  CHECK(select_err("fd00::9", "") == "--include: host fd00::9 is not in the host list");
  CHECK(select_err("", "a,b,c,fd00::1") == "--exclude leaves no host");
}
