// launch --hosts / --hostfile: the flags (config.cc, cluster_config.cc) and what each host's
// agent is started with (cluster.h). The driver itself runs in tests/integration/cluster_test.cc.
#include "muster/launcher/cluster.h"

#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>

#include "muster/launcher/config.h"

using muster::launcher::ClusterPlanInput;
using muster::launcher::HostCommand;
using muster::launcher::LaunchConfig;

namespace {

muster::launcher::HostInfo no_gpu_host() {
  muster::launcher::HostInfo h;
  h.cpu_count = 4;
  h.gpu_count = [] { return 0; };
  return h;
}

LaunchConfig parse_ok(const std::vector<std::string>& args) {
  auto r = muster::launcher::parse_launch_args(args, no_gpu_host());
  INFO(r.error.message());
  REQUIRE(r.error.ok());
  return *r.config;
}

std::string parse_err(const std::vector<std::string>& args) {
  auto r = muster::launcher::parse_launch_args(args, no_gpu_host());
  REQUIRE_FALSE(r.config.has_value());
  return std::string(r.error.message());
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

ClusterPlanInput plan_input() {
  ClusterPlanInput in;
  in.endpoint = "10.0.0.1:4000";
  in.hosted = true;
  in.run_id = "job7";
  in.token = "tok";
  in.launch_path = "/opt/muster/launch";
  in.cwd = "/home/u/my run";
  in.env = {{"PATH", "/usr/bin"}, {"HOME", "/home/u"}, {"NCCL_DEBUG", "INFO"},
            {"AWS_SECRET", "s"}, {"MUSTER_STDIN_WATCH", "0"}};
  in.is_local = [](const std::string& h) { return h == "me"; };
  return in;
}

}  // namespace

TEST_CASE("hosts: the agents get this command's flags, less the ones the driver sets", "[cluster]") {
  LaunchConfig c = parse_ok({"--hosts", "a:2,b", "--nproc", "3", "--max_restarts=2", "-t", "3",
                             "--rdzv_conf=join_timeout=9", "--rdzv-id=x", "--ssh_args=-p 2222",
                             "--env=A,B=1", "--log_dir", "/tmp/l", "prog", "--hosts", "y"});
  REQUIRE(c.cluster.enabled());
  REQUIRE(c.cluster.hosts.size() == 2);
  CHECK(c.cluster.hosts[0].host == "a");
  CHECK(c.cluster.hosts[0].slots == 2);
  CHECK(c.cluster.hosts[1].slots == 0);
  CHECK(c.min_nodes == 2);  // every host, by default
  CHECK(c.max_nodes == 2);
  CHECK(c.rdzv_id == "x");
  CHECK(c.rdzv_conf.timeouts.join_timeout == std::chrono::seconds(9));
  CHECK(c.cluster.ssh_args == std::vector<std::string>{"-p", "2222"});
  CHECK(c.cluster.env == std::vector<std::string>{"A", "B=1"});
  // Kept (canonical spellings), in order; the program's own --hosts is the program's.
  CHECK(c.cluster.agent_args ==
        std::vector<std::string>{"--max_restarts=2", "-t", "3", "--log_dir", "/tmp/l"});
  CHECK(c.program == "prog");
  CHECK(c.program_args == std::vector<std::string>{"--hosts", "y"});
}

TEST_CASE("hosts: the new flags take no prefix away from torchrun's", "[cluster]") {
  // torchrun takes --e for --event_log_handler and --re for --redirects: so does launch,
  // though --env, --exclude and --remote_launch start the same way.
  LaunchConfig c = parse_ok({"--standalone", "--e", "null", "--re", "1", "--log_dir=/tmp", "p"});
  CHECK(c.event_log_handler == "null");
  CHECK(c.redirects == "1");
  CHECK(c.cluster.env_text.empty());
  // Launch's own flags are abbreviated where no torchrun flag shares the prefix.
  LaunchConfig h = parse_ok({"--hosts=a,b", "--ssh=-q", "p"});
  CHECK(h.cluster.ssh_args == std::vector<std::string>{"-q"});
  CHECK(parse_err({"--hostf=/nonexistent/h", "p"}).find("--hostfile /nonexistent/h") !=
        std::string::npos);
  CHECK(parse_err({"--host=a", "p"}).find("ambiguous") != std::string::npos);
}

TEST_CASE("hosts: flags that cannot go with --hosts, and node counts", "[cluster]") {
  CHECK(parse_err({"--hosts=a,b", "--hostfile=f", "p"}).find("not both") != std::string::npos);
  CHECK(parse_err({"--hosts=a,b", "--standalone", "p"}).find("--standalone") != std::string::npos);
  CHECK(parse_err({"--hosts=a,b", "--node_rank=1", "p"}).find("--node_rank") != std::string::npos);
  CHECK(parse_err({"--hosts=a,b", "--local_addr=a", "p"}).find("--local_addr") != std::string::npos);
  CHECK(parse_err({"--hosts=a,b", "--rdzv_backend=static", "p"}).find("c10d") !=
        std::string::npos);
  CHECK(parse_err({"--hosts=a,b", "--nnodes=3", "p"}).find("only 2 hosts") != std::string::npos);
  CHECK(parse_err({"--hosts=a,b", "--nnodes=1:3", "p"}).find("only 2 hosts") != std::string::npos);
  CHECK(parse_err({"--hosts=a,b,c", "--nnodes=2", "p"}).find("--nnodes=2:3") != std::string::npos);
  CHECK(parse_err({"--hosts=a,b", "--rdzv_endpoint=r:0", "p"}).find("port 0") != std::string::npos);
  CHECK(parse_err({"--hosts=a", "--env=1X", "p"}).find("--env") != std::string::npos);
  CHECK(parse_err({"--hosts=a", "--ssh_args=-o 'x", "p"}).find("unclosed") != std::string::npos);
  LaunchConfig elastic = parse_ok({"--hosts=a,b,c", "--nnodes=2:3", "p"});
  CHECK(elastic.min_nodes == 2);
  CHECK(elastic.max_nodes == 3);
  CHECK(elastic.rdzv_id.empty());  // the driver makes one per command
  // gpu/cpu/auto are counted on each host, not here (this fake host has no GPU).
  LaunchConfig gpu = parse_ok({"--hosts=a", "--nproc_per_node=gpu", "p"});
  CHECK(gpu.nproc_spec == "gpu");
  CHECK(parse_err({"--nproc_per_node=gpu", "p"}).find("no CUDA device") != std::string::npos);
}

TEST_CASE("hosts: --hostfile is read, a missing one is named", "[cluster]") {
  char path[] = "/tmp/muster_hostfile_XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::close(fd);
  std::ofstream(path) << "# two hosts\nn1 slots=4\nn2 slots=2\n";
  LaunchConfig c = parse_ok({"--hostfile", path, "--exclude=n1", "p"});
  ::unlink(path);
  REQUIRE(c.cluster.hosts.size() == 1);
  CHECK(c.cluster.hosts[0].host == "n2");
  CHECK(c.cluster.hosts[0].slots == 2);
  CHECK(parse_err({"--hostfile", path, "p"}).find(path) != std::string::npos);
}

TEST_CASE("hosts: --ssh_args is split as a shell splits words", "[cluster]") {
  using muster::launcher::split_shell_words;
  CHECK(*split_shell_words("") == std::vector<std::string>{});
  CHECK(*split_shell_words("  -p 22  -F cfg ") == std::vector<std::string>{"-p", "22", "-F", "cfg"});
  CHECK(*split_shell_words("-o 'ProxyJump=a b' -o \"X=\\\"q\\\"\"") ==
        std::vector<std::string>{"-o", "ProxyJump=a b", "-o", "X=\"q\""});
  CHECK(*split_shell_words("a\\ b c''d") == std::vector<std::string>{"a b", "cd"});
  CHECK_FALSE(split_shell_words("-o \"x").ok());
}

TEST_CASE("hosts: words are quoted for the remote shell", "[cluster]") {
  using muster::launcher::shell_quote;
  CHECK(shell_quote("--nnodes=2:3") == "--nnodes=2:3");
  CHECK(shell_quote("a b") == "'a b'");
  CHECK(shell_quote("it's") == "'it'\\''s'");
  CHECK(shell_quote("$HOME;rm") == "'$HOME;rm'");
  CHECK(shell_quote("") == "''");
}

TEST_CASE("hosts: what the agents' environment gets from here", "[cluster]") {
  auto env = muster::launcher::forwarded_env(
      {{"PATH", "/bin"}, {"HOME", "/root"}, {"NCCL_IB_HCA", "mlx5"}, {"PET_MAX_RESTARTS", "2"},
       {"OMP_NUM_THREADS", "4"}, {"SECRET", "s"}, {"A", "from-here"}, {"MUSTER_RDZV_TOKEN", "old"}},
      {"A", "B=given", "UNSET"}, "new");
  std::map<std::string, std::string> m(env.begin(), env.end());
  CHECK(m.count("PATH") == 1);
  CHECK(m.count("NCCL_IB_HCA") == 1);
  CHECK(m.count("PET_MAX_RESTARTS") == 1);
  CHECK(m.count("OMP_NUM_THREADS") == 1);
  CHECK(m.count("HOME") == 0);
  CHECK(m.count("SECRET") == 0);
  CHECK(m.count("UNSET") == 0);
  CHECK(m["A"] == "from-here");
  CHECK(m["B"] == "given");
  CHECK(m["MUSTER_STDIN_WATCH"] == "1");
  CHECK(m["MUSTER_SCHEDULER_ENV"] == "0");
  CHECK(m["MUSTER_RDZV_TOKEN"] == "new");
  CHECK(std::is_sorted(env.begin(), env.end()));
}

TEST_CASE("hosts: one command per host, over ssh or directly for this machine", "[cluster]") {
  LaunchConfig c = parse_ok({"--hosts=me:2,u@far", "--nproc_per_node=gpu", "--rdzv_conf",
                             "'read_timeout=5'", "--ssh_args=-o BatchMode=no -p 2222",
                             "--max_restarts=1", "prog", "it's"});
  std::vector<HostCommand> plan = muster::launcher::plan_hosts(c, plan_input());
  REQUIRE(plan.size() == 2);
  const HostCommand& local = plan[0];
  CHECK(local.local);
  CHECK(local.argv == std::vector<std::string>{
                          "/opt/muster/launch", "--nnodes=2", "--nproc_per_node=2",
                          "--rdzv_backend=c10d", "--rdzv_endpoint=10.0.0.1:4000",
                          "--rdzv_id=job7", "--rdzv_conf=read_timeout=5,is_host=false",
                          "--max_restarts=1", "--", "prog", "it's"});
  std::map<std::string, std::string> env(local.env.begin(), local.env.end());
  CHECK(env["MUSTER_STDIN_WATCH"] == "1");
  CHECK(env["MUSTER_RDZV_TOKEN"] == "tok");
  CHECK(env.count("AWS_SECRET") == 0);

  const HostCommand& remote = plan[1];
  CHECK_FALSE(remote.local);
  REQUIRE(remote.argv.size() > 4);
  CHECK(remote.argv[0] == "ssh");
  // The user's options come first (ssh keeps the first value of an -o it reads).
  CHECK(std::vector<std::string>(remote.argv.begin() + 1, remote.argv.begin() + 5) ==
        std::vector<std::string>{"-o", "BatchMode=no", "-p", "2222"});
  CHECK(contains(remote.argv, "BatchMode=yes"));
  CHECK(contains(remote.argv, "-T"));
  CHECK(remote.argv[remote.argv.size() - 2] == "u@far");
  const std::string& cmd = remote.argv.back();
  CHECK(cmd.rfind("cd '/home/u/my run' 2>/dev/null; exec env ", 0) == 0);
  CHECK(cmd.find(" MUSTER_RDZV_TOKEN=tok ") != std::string::npos);
  CHECK(cmd.find(" NCCL_DEBUG=INFO ") != std::string::npos);
  CHECK(cmd.find("HOME") == std::string::npos);
  CHECK(cmd.find(" MUSTER_STDIN_WATCH=1 ") != std::string::npos);
  CHECK(cmd.find(" /opt/muster/launch --nnodes=2 --nproc_per_node=gpu ") != std::string::npos);
  CHECK(cmd.find(" -- prog 'it'\\''s'") != std::string::npos);

  // With an rdzvd named by --rdzv_endpoint the driver hosts nothing: no is_host key.
  ClusterPlanInput in = plan_input();
  in.hosted = false;
  plan = muster::launcher::plan_hosts(c, in);
  CHECK(contains(plan[0].argv, "--rdzv_conf=read_timeout=5"));
}

TEST_CASE("hosts: the remote command survives the remote shell word for word", "[cluster]") {
  LaunchConfig c = parse_ok({"--hosts=far", "prog", "a b", "it's", "$HOME", "*", ""});
  ClusterPlanInput in = plan_input();
  in.env.clear();
  in.cwd = "/";
  in.launch_path = "/usr/bin/printf";
  const std::vector<HostCommand> plan = muster::launcher::plan_hosts(c, in);
  // What the remote login shell would run, with printf in place of launch: one line per word.
  char path[] = "/tmp/muster_quote_XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::close(fd);
  const std::string cmd = plan[0].argv.back() + " > " + path;
  // printf's format is its first argument (here --nnodes=1): only words after it are printed
  // when it has a %s; give it one by rewriting the first word.
  std::string with_format = cmd;
  with_format.replace(with_format.find("--nnodes=1"), std::string("--nnodes=1").size(), "'%s\\n'");
  REQUIRE(std::system(with_format.c_str()) == 0);
  std::ifstream out(path);
  std::vector<std::string> words;
  for (std::string line; std::getline(out, line);) words.push_back(line);
  ::unlink(path);
  REQUIRE(words.size() >= 6);
  CHECK(std::vector<std::string>(words.end() - 6, words.end()) ==
        std::vector<std::string>{"prog", "a b", "it's", "$HOME", "*", ""});
}
