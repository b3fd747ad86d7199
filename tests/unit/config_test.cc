#include "muster/launcher/config.h"

#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <csignal>
#include <fstream>
#include <sstream>

#include "muster/ops/build_info.h"
#include "muster/rendezvous/limits.h"
#include "proc.h"

using muster::launcher::HostInfo;
using muster::launcher::LaunchConfig;
using muster::launcher::parse_launch_args;

namespace {

HostInfo fake_host(int cpus, int gpus, int xpus = 0) {
  HostInfo h;
  h.cpu_count = cpus;
  h.gpu_count = [gpus] { return gpus; };
  h.xpu_count = [xpus] { return xpus; };
  return h;
}

// No scheduler (scheduler_env.h): these tests mean the same under srun or mpirun.
const std::map<std::string, std::string> kNoScheduler;

LaunchConfig parse_ok(const std::vector<std::string>& args, HostInfo host = fake_host(8, 0),
                      const std::map<std::string, std::string>& env = kNoScheduler) {
  auto r = parse_launch_args(args, host, env);
  INFO(r.error.message());
  REQUIRE(r.error.ok());
  REQUIRE(r.config.has_value());
  return *r.config;
}

std::string parse_err(const std::vector<std::string>& args, HostInfo host = fake_host(8, 0),
                      const std::map<std::string, std::string>& env = kNoScheduler) {
  auto r = parse_launch_args(args, host, env);
  REQUIRE_FALSE(r.config.has_value());
  REQUIRE_FALSE(r.error.ok());
  return std::string(r.error.message());
}

}  // namespace

TEST_CASE("flags: both spellings give the same configuration", "[config]") {
  LaunchConfig a = parse_ok({"--standalone", "--nproc_per_node=4", "--max_restarts=3",
                             "--shutdown_timeout=2.5", "--monitor_interval=1", "prog", "x"});
  LaunchConfig b = parse_ok({"--standalone", "--nproc-per-node", "4", "--max-restarts", "3",
                             "--shutdown-timeout", "2.5", "--monitor-interval=1", "prog", "x"});
  for (const LaunchConfig* c : {&a, &b}) {
    CHECK(c->standalone);
    CHECK(c->nproc_per_node == 4);
    CHECK(c->max_restarts == 3);
    CHECK(c->shutdown_timeout == std::chrono::milliseconds(2500));
    CHECK(c->monitor_interval == 1.0);
    CHECK(c->program == "prog");
    CHECK(c->program_args == std::vector<std::string>{"x"});
  }
}

TEST_CASE("flags: defaults are torchrun's", "[config]") {
  LaunchConfig c = parse_ok({"--standalone", "prog"});
  CHECK(c.nproc_per_node == 1);
  CHECK(c.max_restarts == 0);
  CHECK(c.min_nodes == 1);
  CHECK(c.max_nodes == 1);
  CHECK(c.role == "default");
  CHECK(c.shutdown_timeout == std::chrono::seconds(30));
  CHECK_FALSE(c.module);
  CHECK_FALSE(c.no_python);
}

TEST_CASE("flags: everything after the program belongs to the program", "[config]") {
  LaunchConfig c =
      parse_ok({"--standalone", "--nproc_per_node=2", "train", "--nproc_per_node=9", "-m", "--"});
  CHECK(c.nproc_per_node == 2);
  CHECK_FALSE(c.module);
  CHECK(c.program == "train");
  CHECK(c.program_args == std::vector<std::string>{"--nproc_per_node=9", "-m", "--"});
}

TEST_CASE("flags: nproc_per_node takes an int, cpu, gpu or auto", "[config]") {
  CHECK(parse_ok({"--standalone", "--nproc_per_node=cpu", "p"}, fake_host(6, 0)).nproc_per_node ==
        6);
  CHECK(parse_ok({"--standalone", "--nproc_per_node=auto", "p"}, fake_host(6, 0)).nproc_per_node ==
        6);
  CHECK(parse_ok({"--standalone", "--nproc_per_node=auto", "p"}, fake_host(6, 2)).nproc_per_node ==
        2);
  CHECK(parse_ok({"--standalone", "--nproc_per_node=gpu", "p"}, fake_host(6, 3)).nproc_per_node ==
        3);
  CHECK_THAT(parse_err({"--standalone", "--nproc_per_node=gpu", "p"}, fake_host(6, 0)),
             Catch::Contains("no CUDA device"));
  // xpu: Intel GPUs; auto: the accelerator present, CUDA first, else the CPUs.
  CHECK(parse_ok({"--standalone", "--nproc_per_node=xpu", "p"}, fake_host(6, 0, 4))
            .nproc_per_node == 4);
  CHECK_THAT(parse_err({"--standalone", "--nproc_per_node=xpu", "p"}, fake_host(6, 2, 0)),
             Catch::Contains("--nproc_per_node=xpu: no Intel GPU is visible"));
  CHECK(parse_ok({"--standalone", "--nproc_per_node=auto", "p"}, fake_host(6, 0, 4))
            .nproc_per_node == 4);
  CHECK(parse_ok({"--standalone", "--nproc_per_node=auto", "p"}, fake_host(6, 2, 4))
            .nproc_per_node == 2);
  CHECK_THAT(parse_err({"--standalone", "--nproc_per_node=hpu", "p"}),
             Catch::Contains("give the number of workers"));
}

TEST_CASE("flags: --version prints the version and commit", "[config]") {
  auto r = parse_launch_args({"--version"}, fake_host(1, 0), kNoScheduler);
  CHECK(r.error.ok());
  CHECK_THAT(r.help, Catch::StartsWith("launch " + std::string(muster::ops::build_version()) +
                                       " (commit "));
  CHECK(r.help.back() == '\n');
  CHECK(muster::ops::build_version() == MUSTER_TEST_PROJECT_VERSION);
  CHECK_FALSE(muster::ops::build_commit().empty());
}

TEST_CASE("flags: -m and --no_python", "[config]") {
  CHECK(parse_ok({"--standalone", "-m", "pkg.mod"}).module);
  CHECK(parse_ok({"--standalone", "--module", "pkg.mod"}).module);
  CHECK(parse_ok({"--standalone", "--no_python", "prog"}).no_python);
  CHECK(parse_ok({"--standalone", "--no-python", "prog"}).no_python);
  CHECK_THAT(parse_err({"--standalone", "-m", "--no_python", "x"}),
             Catch::Contains("cannot be combined"));
}

TEST_CASE("flags: nnodes", "[config]") {
  LaunchConfig c = parse_ok({"--standalone", "--nnodes=1:1", "p"});
  CHECK(c.min_nodes == 1);
  CHECK(c.max_nodes == 1);
  CHECK_THAT(parse_err({"--nnodes=3:2", "p"}), Catch::Contains("MIN 3 is greater than MAX 2"));
  CHECK_THAT(parse_err({"--nnodes=x", "p"}), Catch::Contains("--nnodes"));
  CHECK_THAT(parse_err({"--nnodes=1:2:3", "p"}), Catch::Contains("MIN:MAX"));
  CHECK_THAT(parse_err({"--standalone", "--nnodes=2", "p"}), Catch::Contains("one node"));
}

TEST_CASE("flags: bad input is one clear error", "[config]") {
  CHECK_THAT(parse_err({"--standalone", "--nproc_per_node=0", "p"}),
             Catch::Contains("--nproc_per_node"));
  CHECK_THAT(parse_err({"--standalone", "--nproc_per_node=-2", "p"}),
             Catch::Contains("--nproc_per_node"));
  CHECK_THAT(parse_err({"--standalone", "--nproc_per_node=abc", "p"}), Catch::Contains("'abc'"));
  CHECK_THAT(parse_err({"--standalone", "--bogus", "p"}), Catch::Contains("--bogus"));
  CHECK_THAT(parse_err({"--standalone", "--max_restarts=x", "p"}), Catch::Contains("max_restarts"));
  CHECK_THAT(parse_err({"--standalone", "--max_restarts=-1", "p"}),
             Catch::Contains("max_restarts"));
  CHECK_THAT(parse_err({"--standalone", "--shutdown_timeout=-1", "p"}),
             Catch::Contains("shutdown_timeout"));
  CHECK_THAT(parse_err({"--standalone"}), Catch::Contains("missing the program"));
  for (const auto& args : {std::vector<std::string>{"--nproc_per_node=0", "p"},
                           std::vector<std::string>{"--bogus", "p"}}) {
    CHECK(parse_err(args).find('\n') == std::string::npos);
  }
}

TEST_CASE("flags: --help", "[config]") {
  auto r = parse_launch_args({"--help"}, fake_host(1, 0));
  CHECK_FALSE(r.config.has_value());
  CHECK(r.error.ok());
  CHECK_THAT(r.help, Catch::Contains("--nproc_per_node"));
}

TEST_CASE("entrypoint: executables, scripts and modules", "[config]") {
  muster::testing::TempDir dir;
  const std::string exe = dir.file("tool");
  std::ofstream(exe) << "#!/bin/sh\n";
  ::chmod(exe.c_str(), 0755);
  const std::string plain = dir.file("plain");
  std::ofstream(plain) << "data\n";
  const std::string script = dir.file("train.py");
  std::ofstream(script) << "print(1)\n";
  const std::string python = dir.file("python3");
  std::ofstream(python) << "#!/bin/sh\n";
  ::chmod(python.c_str(), 0755);
  std::map<std::string, std::string> env{{"PATH", dir.path() + ":/nonexistent"}};

  auto resolve = [&](const std::vector<std::string>& args) {
    return muster::launcher::resolve_entrypoint(parse_ok(args), env);
  };
  auto by_path = resolve({"--standalone", exe, "a"});
  REQUIRE(by_path.ok());
  CHECK(by_path->path == exe);
  CHECK(by_path->argv == std::vector<std::string>{exe, "a"});

  auto by_name = resolve({"--standalone", "tool", "a"});
  REQUIRE(by_name.ok());
  CHECK(by_name->path == exe);
  CHECK(by_name->argv == std::vector<std::string>{"tool", "a"});

  auto py = resolve({"--standalone", script, "--lr", "1"});
  REQUIRE(py.ok());
  CHECK(py->path == python);
  CHECK(py->argv == std::vector<std::string>{python, "-u", script, "--lr", "1"});
  CHECK(py->name == script);

  auto mod = resolve({"--standalone", "-m", "pkg.train", "x"});
  REQUIRE(mod.ok());
  CHECK(mod->argv == std::vector<std::string>{python, "-u", "-m", "pkg.train", "x"});

  auto nopy = resolve({"--standalone", "--no_python", "tool"});
  REQUIRE(nopy.ok());
  CHECK(nopy->path == exe);

  env["PYTHON_EXEC"] = exe;
  auto custom = resolve({"--standalone", script});
  REQUIRE(custom.ok());
  CHECK(custom->path == exe);

  CHECK_THAT(std::string(resolve({"--standalone", plain}).status().message()),
             Catch::Contains("not executable"));
  CHECK_THAT(std::string(resolve({"--standalone", dir.file("missing")}).status().message()),
             Catch::Contains("does not exist"));
  CHECK_THAT(std::string(resolve({"--standalone", "no-such-tool"}).status().message()),
             Catch::Contains("not found on PATH"));
  CHECK_THAT(std::string(resolve({"--standalone", dir.file("missing.py")}).status().message()),
             Catch::Contains("does not exist"));
}

TEST_CASE("rendezvous flags: endpoints, IPv6 in brackets, default port", "[config]") {
  using muster::launcher::parse_endpoint;
  auto e = parse_endpoint("node0:1234", 29400);
  REQUIRE(e.ok());
  CHECK(e->host == "node0");
  CHECK(e->port == 1234);
  CHECK(parse_endpoint("node0", 29400)->port == 29400);
  auto v6 = parse_endpoint("[::1]:5000", 29400);
  REQUIRE(v6.ok());
  CHECK(v6->host == "::1");
  CHECK(v6->port == 5000);
  CHECK(v6->to_string() == "[::1]:5000");
  CHECK(parse_endpoint("[fe80::1]", 29400)->port == 29400);
  CHECK(parse_endpoint("localhost:0", 29400)->port == 0);  // a free port: the caller decides
  for (const char* bad : {"", ":1", "h:", "h:-1", "h:70000", "h:x", "[::1", "[::1]x", "::1:5"}) {
    INFO(bad);
    CHECK_FALSE(parse_endpoint(bad, 29400).ok());
  }
}

TEST_CASE("rendezvous flags: rdzv_conf keys and units", "[config]") {
  using muster::launcher::parse_rdzv_conf;
  auto c = parse_rdzv_conf(
      "join_timeout=5,last_call_timeout=0.5,close_timeout=2,keep_alive_interval=1,"
      "keep_alive_max_attempt=4,read_timeout=7,token=abc,is_host=false");
  REQUIRE(c.ok());
  CHECK(c->timeouts.join_timeout == std::chrono::seconds(5));
  CHECK(c->timeouts.last_call_timeout == std::chrono::milliseconds(500));
  CHECK(c->close_timeout == std::chrono::seconds(2));
  CHECK(c->timeouts.keep_alive_interval == std::chrono::seconds(1));
  CHECK(c->timeouts.keep_alive_max_attempt == 4);
  CHECK(c->read_timeout == std::chrono::seconds(7));
  CHECK(c->token == "abc");
  REQUIRE(c->is_host.has_value());
  CHECK_FALSE(*c->is_host);
  auto d = parse_rdzv_conf("");
  REQUIRE(d.ok());
  CHECK(d->timeouts.join_timeout == std::chrono::seconds(600));
  CHECK(d->timeouts.last_call_timeout == std::chrono::seconds(30));
  CHECK_FALSE(d->is_host.has_value());
  CHECK(d->ignored_keys.empty());
  CHECK_FALSE(parse_rdzv_conf("join_timeout=soon").ok());
  CHECK_FALSE(parse_rdzv_conf("join_timeout").ok());
  CHECK_FALSE(parse_rdzv_conf("keep_alive_max_attempt=0").ok());
  CHECK_FALSE(parse_rdzv_conf("keep_alive_interval=0").ok());
  CHECK_FALSE(parse_rdzv_conf("is_host=maybe").ok());
  // The run's TCPStore-protocol store for the workers: on unless turned off.
  CHECK(d->use_agent_store);
  auto off = parse_rdzv_conf("use_agent_store=false");
  REQUIRE(off.ok());
  CHECK_FALSE(off->use_agent_store);
  CHECK(off->ignored_keys.empty());
  // Its agents' cache of what their node set: on unless turned off.
  CHECK(d->store_cache);
  auto uncached = parse_rdzv_conf("store_cache=false");
  REQUIRE(uncached.ok());
  CHECK_FALSE(uncached->store_cache);
  CHECK(uncached->use_agent_store);
  CHECK(uncached->ignored_keys.empty());
  CHECK_FALSE(parse_rdzv_conf("store_cache=sometimes").ok());
  auto bad = parse_rdzv_conf("use_agent_store=perhaps");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()),
             Catch::Contains("use_agent_store: expected true or false, got 'perhaps'"));
}

TEST_CASE("rendezvous flags: modes", "[config]") {
  using muster::launcher::RdzvMode;
  CHECK(parse_ok({"--standalone", "p"}).mode == RdzvMode::kEmbedded);
  // Plain single node, no endpoint and no master port: --standalone, as torchrun >= 2.6 has it
  // (c10d on a free port, a random run id), so two such jobs on one host do not collide.
  LaunchConfig single = parse_ok({"p"});
  CHECK(single.mode == RdzvMode::kEmbedded);
  CHECK(single.standalone);
  CHECK(single.rdzv_backend == "c10d");
  // A master port given keeps torchrun's static defaults, served privately.
  LaunchConfig fixed = parse_ok({"--master_port=29500", "p"});
  CHECK(fixed.mode == RdzvMode::kEmbedded);
  CHECK_FALSE(fixed.standalone);
  CHECK(fixed.master_addr == "127.0.0.1");
  CHECK(fixed.master_port == 29500);
  CHECK_FALSE(parse_ok({"--nnodes=2", "--rdzv_endpoint=n0:29600", "p"}).standalone);
  // Static with an endpoint: the workers' MASTER_ADDR is the endpoint's host (node 0), as
  // torchrun derives it, not 127.0.0.1; MASTER_PORT stays apart from the server's port.
  LaunchConfig ep = parse_ok({"--nnodes=2", "--node_rank=1", "--rdzv_endpoint=n0:29600", "p"});
  CHECK(ep.mode == RdzvMode::kStatic);
  CHECK(ep.master_addr == "n0");
  CHECK(ep.master_port == 29500);
  CHECK(ep.endpoint.to_string() == "n0:29600");
  LaunchConfig clash = parse_ok({"--nnodes=2", "--rdzv_endpoint=n0:29500", "p"});
  CHECK(clash.master_port == 29501);
  LaunchConfig given = parse_ok({"--nnodes=2", "--rdzv_endpoint=n0:29500",
                                 "--master_addr=10.1.1.1", "--master_port=29500", "p"});
  CHECK(given.master_addr == "10.1.1.1");  // what the user says, stays
  CHECK(given.master_port == 29500);
  LaunchConfig c10d = parse_ok({"--nnodes=1:4", "--rdzv_backend=c10d", "--rdzv_endpoint=n0", "p"});
  CHECK(c10d.mode == RdzvMode::kC10d);
  CHECK(c10d.endpoint.to_string() == "n0:29400");
  CHECK(c10d.min_nodes == 1);
  CHECK(c10d.max_nodes == 4);
  LaunchConfig st =
      parse_ok({"--nnodes=2", "--node_rank=1", "--master_addr=n0", "--master_port=1000", "p"});
  CHECK(st.mode == RdzvMode::kStatic);
  CHECK(st.node_rank == 1);
  CHECK(st.endpoint.to_string() == "n0:1001");  // MASTER_PORT stays the workers'
  CHECK_THAT(parse_err({"--nnodes=2", "--rdzv_backend=c10d", "p"}),
             Catch::Contains("needs --rdzv_endpoint"));
}

namespace {

// Every field of a parsed configuration, for comparing two parses.
std::string describe(const LaunchConfig& c) {
  std::ostringstream os;
  os << c.standalone << c.min_nodes << ":" << c.max_nodes << " nproc=" << c.nproc_per_node
     << " restarts=" << c.max_restarts << " monitor=" << c.monitor_interval
     << " start=" << c.start_method << " backend=" << c.rdzv_backend << " ep=" << c.rdzv_endpoint
     << " id=" << c.rdzv_id << " conf=" << c.rdzv_conf_text << " node_rank=" << c.node_rank
     << " master=" << c.master_addr << ":" << c.master_port << " local=" << c.local_addr
     << " role=" << c.role << " m=" << c.module << " nopy=" << c.no_python
     << " run_path=" << c.run_path << " log_dir=" << c.log_dir << " r=" << c.redirects
     << " t=" << c.tee << " filter=" << c.local_ranks_filter << " events=" << c.event_log_handler
     << " signals=" << c.signals_to_handle << " shutdown=" << c.shutdown_timeout.count()
     << " prefix=" << c.log_line_prefix_template << " program=" << c.program;
  return os.str();
}

// Sets PET_* variables for one scope.
struct ScopedEnv {
  std::vector<std::string> keys;
  explicit ScopedEnv(const std::map<std::string, std::string>& vars) {
    for (const auto& [k, v] : vars) {
      ::setenv(k.c_str(), v.c_str(), 1);
      keys.push_back(k);
    }
  }
  ~ScopedEnv() {
    for (const auto& k : keys) ::unsetenv(k.c_str());
  }
};

}  // namespace

TEST_CASE("flags: every flag by underscore, by dash and by PET_* parses the same", "[config]") {
  const std::vector<std::pair<std::string, std::string>> flags{
      {"nnodes", "2:3"}, {"nproc_per_node", "3"}, {"max_restarts", "4"},
      {"monitor_interval", "0.5"}, {"start_method", "fork"}, {"rdzv_backend", "c10d"},
      {"rdzv_endpoint", "node0:1234"}, {"rdzv_id", "job7"}, {"rdzv_conf", "join_timeout=9"},
      {"local_addr", "10.1.2.3"}, {"role", "trainer"}, {"log_dir", "/tmp/logs"},
      {"redirects", "0:1,1:2"}, {"tee", "3"}, {"local_ranks_filter", "0,2"},
      {"event_log_handler", "null"}, {"signals_to_handle", "SIGTERM,SIGUSR1"},
      {"shutdown_timeout", "7"}, {"node_rank", "1"}, {"master_addr", "m0"},
      {"master_port", "2222"}, {"log_line_prefix_template", "<${rank}>"}};
  std::vector<std::string> underscore, dash;
  std::map<std::string, std::string> pet;
  for (const auto& [name, value] : flags) {
    underscore.push_back("--" + name + "=" + value);
    std::string d = name;
    std::replace(d.begin(), d.end(), '_', '-');
    dash.push_back("--" + d);
    dash.push_back(value);
    std::string env = "PET_" + name;
    for (char& ch : env) ch = static_cast<char>(std::toupper(ch));
    pet[env] = value;
  }
  underscore.push_back("train");
  dash.push_back("train");
  const std::string a = describe(parse_ok(underscore));
  const std::string b = describe(parse_ok(dash));
  std::string c;
  {
    ScopedEnv env(pet);
    c = describe(parse_ok({"train"}));
  }
  CHECK(a == b);
  CHECK(a == c);
  CHECK_THAT(a, Catch::Contains("nproc=3"));
  // Flags (no value) through PET_*: 1 turns them on.
  {
    ScopedEnv env({{"PET_STANDALONE", "1"}, {"PET_NO_PYTHON", "1"}});
    LaunchConfig f = parse_ok({"train"});
    CHECK(f.standalone);
    CHECK(f.no_python);
  }
  {
    ScopedEnv env({{"PET_MODULE", "1"}, {"PET_STANDALONE", "1"}});
    CHECK(parse_ok({"pkg.mod"}).module);
  }
  {
    ScopedEnv env({{"PET_RUN_PATH", "1"}, {"PET_STANDALONE", "1"}});
    CHECK(parse_ok({"script"}).run_path);
  }
}

TEST_CASE("flags: an explicit flag wins over PET_*", "[config]") {
  ScopedEnv env({{"PET_NPROC_PER_NODE", "5"}, {"PET_MAX_RESTARTS", "9"}});
  LaunchConfig c = parse_ok({"--standalone", "--nproc_per_node=2", "p"});
  CHECK(c.nproc_per_node == 2);
  CHECK(c.max_restarts == 9);
}

TEST_CASE("flags: output and signal options", "[config]") {
  LaunchConfig c = parse_ok({"--standalone", "--nproc_per_node=3", "-r", "0:1,2:3", "-t", "2",
                             "--local_ranks_filter=1", "--signals_to_handle=TERM,SIGUSR1", "p"});
  CHECK(c.redirect_of == std::vector<int>{1, 0, 1});  // rank 2's stderr is teed: not redirected
  CHECK(c.tee_of == std::vector<int>{2, 2, 2});
  CHECK(c.console_of == std::vector<bool>{false, true, false});
  CHECK(c.signals == std::vector<int>{SIGTERM, SIGUSR1});
  LaunchConfig d = parse_ok({"--standalone", "--nproc_per_node=2", "p"});
  CHECK(d.console_of == std::vector<bool>{true, true});
  CHECK(d.signals == std::vector<int>{SIGTERM, SIGINT, SIGHUP, SIGQUIT});
  CHECK_THAT(parse_err({"--standalone", "--redirects=4", "p"}), Catch::Contains("--redirects"));
  CHECK_THAT(parse_err({"--standalone", "--tee=0:x", "p"}), Catch::Contains("--tee"));
  CHECK_THAT(parse_err({"--standalone", "--local_ranks_filter=a", "p"}),
             Catch::Contains("--local_ranks_filter"));
  CHECK_THAT(parse_err({"--standalone", "--signals_to_handle=SIGKILL", "p"}),
             Catch::Contains("--signals_to_handle"));
  CHECK_THAT(parse_err({"--standalone", "--signals_to_handle=SIGNOPE", "p"}),
             Catch::Contains("SIGNOPE"));
  CHECK_THAT(parse_err({"--standalone", "--logs_specs=my.Specs", "p"}),
             Catch::Contains("Python plug-in"));
  CHECK_THAT(parse_err({"--standalone", "--event_log_handler=kafka", "p"}),
             Catch::Contains("event_log_handler"));
  CHECK_THAT(parse_err({"--standalone", "--no_python", "--module", "p"}),
             Catch::Contains("cannot be combined"));
}

TEST_CASE("flags: --run_path takes precedence over --no_python and -m, as torchrun's",
          "[config]") {
  for (const char* other : {"--no_python", "-m"}) {
    INFO(other);
    LaunchConfig c = parse_ok({"--standalone", "--run_path", other, "job"});
    CHECK(c.run_path);
    CHECK_FALSE(c.no_python);
    CHECK_FALSE(c.module);
    muster::testing::TempDir dir;
    const std::string job = dir.file("job");
    std::ofstream(job) << "print('hi')\n";
    const std::string py = dir.file("python3");
    std::ofstream(py) << "#!/bin/sh\n";
    ::chmod(py.c_str(), 0755);
    c.program = job;
    auto e = muster::launcher::resolve_entrypoint(c, {{"PATH", dir.path()}});
    REQUIRE(e.ok());
    CHECK(e->argv == std::vector<std::string>{py, "-u", job});  // a script, never -m or direct
  }
}

TEST_CASE("flags: --log_line_prefix_template (torchrun 2.x), over the variable, ${hostname}",
          "[config]") {
  auto prefix = [](const std::vector<std::string>& args,
                   const std::map<std::string, std::string>& env) {
    auto r = parse_launch_args(args, fake_host(8, 0), env);
    INFO(r.error.message());
    REQUIRE(r.config.has_value());
    return r.config->log_line_prefix_template;
  };
  const std::map<std::string, std::string> var{
      {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[v${rank}]"}};
  CHECK(prefix({"--standalone", "p"}, {}).empty());  // the default prefix
  CHECK(prefix({"--standalone", "p"}, var) == "[v${rank}]");
  CHECK(prefix({"--standalone", "--log_line_prefix_template=<${local_rank}>", "p"}, var) ==
        "<${local_rank}>");
  CHECK(prefix({"--standalone", "--log-line-prefix-template", "<${rank}>", "p"}, {}) ==
        "<${rank}>");
  // Given empty, the flag leaves the variable's (torchrun's `flag or getenv(...)`).
  CHECK(prefix({"--standalone", "--log_line_prefix_template=", "p"}, var) == "[v${rank}]");
  // ${hostname} and $hostname: this host's short name, for every worker of the node; `$$` and
  // other names are left for the agent's per-worker expansion.
  char name[256] = {};
  REQUIRE(::gethostname(name, sizeof name - 1) == 0);
  const std::string host = name;
  CHECK(prefix({"--standalone", "--log_line_prefix_template=${hostname}:${rank}: ", "p"}, {}) ==
        host + ":${rank}: ");
  CHECK(prefix({"--standalone", "p"},
               {{"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "$hostname|$$hostname|$hostnames|"}}) ==
        host + "|$$hostname|$hostnames|");
  // A flag of torchrun's takes part in argparse's prefixes: --log_ is now ambiguous, as there,
  // and --log_d still names --log_dir.
  CHECK(parse_err({"--standalone", "--log_=x", "p"}) ==
        "ambiguous option '--log_' could match --log_dir, --log_line_prefix_template");
  CHECK(parse_ok({"--standalone", "--log_d=/tmp/x", "p"}).log_dir == "/tmp/x");
}

TEST_CASE("rendezvous flags: durations above their bound are usage errors naming it",
          "[config]") {
  using muster::launcher::parse_rdzv_conf;
  namespace limits = muster::rendezvous::limits;
  auto secs = [](std::chrono::milliseconds d) {
    return std::to_string(std::chrono::duration_cast<std::chrono::seconds>(d).count());
  };
  struct Case {
    const char* key;
    std::chrono::milliseconds bound;
  };
  for (const Case& c : {Case{"join_timeout", limits::kMaxJoinTimeout},
                        Case{"last_call_timeout", limits::kMaxLastCallTimeout},
                        Case{"keep_alive_interval", limits::kMaxKeepAliveInterval},
                        Case{"close_timeout", limits::kMaxCloseTimeout},
                        Case{"read_timeout", limits::kMaxReadTimeout}}) {
    INFO(c.key);
    // Far beyond the bound (10^10 s overflowed the milliseconds before), then just above it.
    for (const std::string& v : {std::string("10000000000"), std::string("1e300"),
                                 std::to_string(c.bound.count() / 1000 + 1)}) {
      auto r = parse_rdzv_conf(std::string(c.key) + "=" + v);
      INFO(v);
      REQUIRE_FALSE(r.ok());
      CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
      CHECK_THAT(std::string(r.status().message()), Catch::Contains(c.key));
      CHECK_THAT(std::string(r.status().message()), Catch::Contains("limit of " + secs(c.bound)));
    }
    // The bound itself is accepted.
    auto at = parse_rdzv_conf(std::string(c.key) + "=" + secs(c.bound));
    REQUIRE(at.ok());
  }
  auto attempts = parse_rdzv_conf("keep_alive_max_attempt=" +
                                  std::to_string(limits::kMaxKeepAliveAttempts + 1));
  REQUIRE_FALSE(attempts.ok());
  CHECK_THAT(std::string(attempts.status().message()),
             Catch::Contains("limit of " + std::to_string(limits::kMaxKeepAliveAttempts)));
  CHECK_FALSE(parse_rdzv_conf("keep_alive_max_attempt=99999999999999999999").ok());
  // Each within its bound, but the window they make (interval x attempts) is not.
  auto window = parse_rdzv_conf("keep_alive_interval=600,keep_alive_max_attempt=7");
  REQUIRE_FALSE(window.ok());
  CHECK_THAT(std::string(window.status().message()), Catch::Contains("liveness window"));
  CHECK(parse_rdzv_conf("keep_alive_interval=600,keep_alive_max_attempt=6").ok());
  CHECK(parse_rdzv_conf("keep_alive_max_attempt=" +
                        std::to_string(limits::kMaxKeepAliveAttempts))
            .ok());

  for (const std::string& v : {std::string("10000000000"), std::string("1e300"),
                               std::to_string(limits::kMaxShutdownTimeout.count() / 1000 + 1)}) {
    INFO(v);
    CHECK_THAT(parse_err({"--shutdown_timeout=" + v, "prog"}),
               Catch::Contains("--shutdown_timeout") &&
                   Catch::Contains("limit of " + secs(limits::kMaxShutdownTimeout)));
  }
  CHECK(parse_ok({"--shutdown_timeout=" + secs(limits::kMaxShutdownTimeout), "prog"})
            .shutdown_timeout == limits::kMaxShutdownTimeout);
}

// --- issue 12: torchrun's habits ------------------------------------------------------------

TEST_CASE("flags: --flag= is an empty value and never takes the next argument", "[config]") {
  LaunchConfig c = parse_ok({"--standalone", "--rdzv_id=", "/bin/echo", "HI"});
  CHECK(c.rdzv_id.empty());
  CHECK(c.program == "/bin/echo");
  CHECK(c.program_args == std::vector<std::string>{"HI"});
  LaunchConfig d = parse_ok({"--standalone", "--log_dir=", "--rdzv-conf=", "--local_addr=", "p"});
  CHECK(d.log_dir.empty());
  CHECK(d.rdzv_conf_text.empty());
  CHECK(d.program == "p");
  // A number cannot be empty (CLI11 would read 0: a shutdown without grace).
  for (const char* flag : {"--max_restarts=", "--shutdown_timeout=", "--node_rank=",
                           "--master_port=", "--monitor_interval="}) {
    INFO(flag);
    std::string name = std::string(flag).substr(0, std::string(flag).size() - 1);
    CHECK_THAT(parse_err({"--standalone", flag, "p"}),
               Catch::Contains(name) && Catch::Contains("expected a number"));
  }
  CHECK_THAT(parse_err({"--standalone", "--nproc_per_node=", "p"}),
             Catch::Contains("--nproc_per_node"));
  // The program's own "--x=" is its business.
  CHECK(parse_ok({"--standalone", "p", "--rdzv_id=", "q"}).program_args ==
        std::vector<std::string>{"--rdzv_id=", "q"});
}

TEST_CASE("flags: unambiguous prefixes of long flags, as argparse", "[config]") {
  LaunchConfig c = parse_ok({"--stand", "--nproc", "2", "--redirect=3", "--max-re=4",
                             "--rdzv_i=job", "--mod", "pkg.main", "--nproc", "9"});
  CHECK(c.standalone);
  CHECK(c.nproc_per_node == 2);
  CHECK(c.redirect_of == std::vector<int>{3, 3});
  CHECK(c.max_restarts == 4);
  CHECK(c.rdzv_id == "job");
  CHECK(c.module);
  CHECK(c.program == "pkg.main");
  CHECK(c.program_args == std::vector<std::string>{"--nproc", "9"});  // the program's own
  // A value that looks like a prefix is a value.
  CHECK(parse_ok({"--standalone", "--role", "--stand", "p"}).role == "--stand");
  CHECK(parse_ok({"--standalone", "-r", "1", "--log_d", "/tmp/x", "p"}).log_dir == "/tmp/x");
  // Ambiguous: one line naming each candidate once (one spelling per flag).
  const std::string no = parse_err({"--standalone", "--no", "p"});
  CHECK(no == "ambiguous option '--no' could match --no_python, --node_rank");
  CHECK_THAT(parse_err({"--standalone", "--rdzv=x", "p"}),
             Catch::Contains("--rdzv_backend") && Catch::Contains("--rdzv_endpoint") &&
                 Catch::Contains("--rdzv_id") && Catch::Contains("--rdzv_conf"));
  CHECK_THAT(parse_err({"--standalone", "--nprocs=2", "p"}), Catch::Contains("--nprocs"));
}

TEST_CASE("flags: a stream both redirected and teed is teed (torchrun's rule)", "[config]") {
  LaunchConfig both = parse_ok({"--standalone", "--nproc_per_node=2", "-r", "3", "-t", "3", "p"});
  CHECK(both.redirect_of == std::vector<int>{0, 0});
  CHECK(both.tee_of == std::vector<int>{3, 3});
  LaunchConfig out = parse_ok({"--standalone", "-r", "3", "-t", "1", "p"});
  CHECK(out.redirect_of == std::vector<int>{2});  // stderr: file only
  CHECK(out.tee_of == std::vector<int>{1});       // stdout: file and console
  LaunchConfig ranks =
      parse_ok({"--standalone", "--nproc_per_node=2", "-r", "0:3,1:2", "-t", "0:2", "p"});
  CHECK(ranks.redirect_of == std::vector<int>{1, 2});
  CHECK(ranks.tee_of == std::vector<int>{2, 0});
}

TEST_CASE("flags: --log_dir=/dev/null writes no files, every stream stays on the console",
          "[config]") {
  LaunchConfig c = parse_ok({"--standalone", "--nproc_per_node=2", "--log_dir=/dev/null", "-r",
                             "3", "-t", "1", "--local_ranks_filter=1", "p"});
  CHECK(c.log_dir.empty());
  CHECK(c.redirect_of == std::vector<int>{0, 0});
  CHECK(c.tee_of == std::vector<int>{0, 0});
  CHECK(c.console_of == std::vector<bool>{false, true});  // the filter still applies
}

TEST_CASE("rendezvous flags: rdzv_conf accepts torchrun's pass-through keys and quotes",
          "[config]") {
  using muster::launcher::parse_rdzv_conf;
  auto q = parse_rdzv_conf("'join_timeout=5,last_call_timeout=1,timeout=5'");
  REQUIRE(q.ok());
  CHECK(q->timeouts.join_timeout == std::chrono::seconds(5));
  CHECK(q->timeouts.last_call_timeout == std::chrono::seconds(1));
  CHECK(q->ignored_keys == std::vector<std::string>{"timeout"});
  auto dq = parse_rdzv_conf("\" join_timeout = 7 , read_timeout=3 \"");
  REQUIRE(dq.ok());
  CHECK(dq->timeouts.join_timeout == std::chrono::seconds(7));
  CHECK(dq->read_timeout == std::chrono::seconds(3));
  CHECK(dq->ignored_keys.empty());
  auto pass = parse_rdzv_conf(
      "timeout=900,heartbeat_timeout=10,store_type=tcp,use_libuv=1,my_backend_knob=x,"
      "keep_alive_interval=1");
  REQUIRE(pass.ok());
  CHECK(pass->ignored_keys == std::vector<std::string>{"timeout", "heartbeat_timeout",
                                                       "store_type", "use_libuv",
                                                       "my_backend_knob"});
  CHECK(pass->timeouts.keep_alive_interval == std::chrono::seconds(1));
  // An unpaired quote stays part of the key, which then does nothing (and is warned about).
  CHECK(parse_rdzv_conf("'join_timeout=5")->ignored_keys ==
        std::vector<std::string>{"'join_timeout"});
  // Still refused: what is not key=value, a known key's bad value.
  CHECK_FALSE(parse_rdzv_conf("=5").ok());
  CHECK_FALSE(parse_rdzv_conf("'join_timeout=soon'").ok());
  // The liveness window check still holds with pass-through keys around it.
  CHECK_FALSE(parse_rdzv_conf("'timeout=1,keep_alive_interval=600,keep_alive_max_attempt=7'").ok());
  // Through the flags too.
  LaunchConfig c = parse_ok({"--standalone", "--rdzv-conf='join_timeout=5,timeout=5'", "p"});
  CHECK(c.rdzv_conf.timeouts.join_timeout == std::chrono::seconds(5));
  CHECK(c.rdzv_conf.ignored_keys == std::vector<std::string>{"timeout"});
}

TEST_CASE("rendezvous flags: --rdzv_endpoint with port 0 is a private server on a free port",
          "[config]") {
  using muster::launcher::RdzvMode;
  LaunchConfig c = parse_ok(
      {"--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "--nnodes=1", "--rdzv_id=j1", "p"});
  CHECK(c.mode == RdzvMode::kEmbedded);
  CHECK(c.rdzv_id == "j1");
  CHECK(parse_ok({"--rdzv_endpoint=127.0.0.1:0", "p"}).mode == RdzvMode::kEmbedded);  // static
  CHECK_THAT(parse_err({"--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "--nnodes=1:2",
                        "p"}),
             Catch::Contains("port 0") && Catch::Contains("single node"));
  CHECK_THAT(parse_err({"--nnodes=2", "--node_rank=0", "--rdzv_endpoint=n0:0", "p"}),
             Catch::Contains("port 0"));
}

TEST_CASE("flags: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, below the flag and PET_SHUTDOWN_TIMEOUT",
          "[config]") {
  // Read from the environment given to parse_launch_args, not from the process's.
  const std::map<std::string, std::string> seven{{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7"}};
  CHECK(parse_ok({"--standalone", "p"}, fake_host(8, 0), seven).shutdown_timeout ==
        std::chrono::seconds(7));
  CHECK(parse_ok({"--standalone", "--shutdown_timeout=2", "p"}, fake_host(8, 0), seven)
            .shutdown_timeout == std::chrono::seconds(2));
  {
    ScopedEnv env(std::map<std::string, std::string>{{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7"}});
    CHECK(parse_ok({"--standalone", "p"}).shutdown_timeout == std::chrono::seconds(30));
  }
  {
    ScopedEnv env(std::map<std::string, std::string>{{"PET_SHUTDOWN_TIMEOUT", "3"}});
    CHECK(parse_ok({"--standalone", "p"}, fake_host(8, 0), seven).shutdown_timeout ==
          std::chrono::seconds(3));
  }
  for (const char* bad : {"soon", "-1", "", "1e300"}) {
    INFO(bad);
    const std::map<std::string, std::string> env{{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", bad}};
    CHECK_THAT(parse_err({"--standalone", "p"}, fake_host(8, 0), env),
               Catch::Contains("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"));
    // A flag given makes the variable irrelevant, even when it is bad.
    CHECK(parse_ok({"--standalone", "--shutdown_timeout=1", "p"}, fake_host(8, 0), env)
              .shutdown_timeout == std::chrono::seconds(1));
  }
}

TEST_CASE("flags: accelerators launch cannot count are one clear error", "[config]") {
  for (const char* name : {"npu", "hpu", "mtia", "mps", "musa", "privateuseone"}) {
    INFO(name);
    const std::string e = parse_err({"--standalone", std::string("--nproc-per-node=") + name, "p"});
    CHECK(e == std::string("--nproc_per_node=") + name +
                   ": launch counts CUDA devices (gpu), Intel GPUs (xpu), either (auto) and CPUs "
                   "(cpu); give the number of workers");
    CHECK(e.find('\n') == std::string::npos);
  }
}

TEST_CASE("flags: --event_log_handler=dynamic_rendezvous is accepted", "[config]") {
  CHECK(parse_ok({"--standalone", "--event-log-handler=dynamic_rendezvous", "p"})
            .event_log_handler == "dynamic_rendezvous");
  CHECK(parse_ok({"--standalone", "--event_log_handler", "dynamic_rendezvous", "p"})
            .event_log_handler == "dynamic_rendezvous");
}

TEST_CASE("logging: MUSTER_LOG_LEVEL, else torchrun's LOGLEVEL, else warnings", "[config]") {
  using muster::launcher::resolve_log_level;
  CHECK(*resolve_log_level(nullptr, nullptr) == "warning");
  CHECK(*resolve_log_level(nullptr, "INFO") == "info");
  CHECK(*resolve_log_level(nullptr, "debug") == "debug");
  CHECK(*resolve_log_level(nullptr, "WARN") == "warning");
  CHECK(*resolve_log_level(nullptr, "CRITICAL") == "critical");
  CHECK(*resolve_log_level(nullptr, "FATAL") == "critical");
  CHECK(*resolve_log_level(nullptr, "NOTSET") == "trace");
  CHECK(*resolve_log_level("error", "DEBUG") == "error");  // MUSTER_LOG_LEVEL wins
  CHECK(*resolve_log_level("error", "bogus") == "error");  // and LOGLEVEL is then not read
  auto bad = resolve_log_level(nullptr, "loud");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()),
             Catch::Contains("LOGLEVEL: 'loud'") && Catch::Contains("DEBUG, INFO"));
}

TEST_CASE("flags: --virtual_local_rank, both spellings and PET_VIRTUAL_LOCAL_RANK", "[config]") {
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  CHECK_FALSE(parse_ok({"--standalone", "prog"}).virtual_local_rank);
  CHECK(parse_ok({"--virtual_local_rank", "prog"}).virtual_local_rank);
  CHECK(parse_ok({"--virtual-local-rank", "--nproc_per_node=4", "prog"}).virtual_local_rank);
  {
    ScopedEnv env(std::map<std::string, std::string>{{"PET_VIRTUAL_LOCAL_RANK", "1"}});
    CHECK(parse_ok({"prog"}).virtual_local_rank);
  }
  SECTION("CUDA_VISIBLE_DEVICES must name a device for every local rank") {
    const std::map<std::string, std::string> env{{"CUDA_VISIBLE_DEVICES", "3,5"}};
    const HostInfo h = fake_host(8, 0);
    CHECK(parse_ok({"--virtual-local-rank", "--nproc_per_node=2", "prog"}, h, env)
              .virtual_local_rank);
    CHECK(parse_err({"--virtual-local-rank", "--nproc_per_node=3", "prog"}, h, env) ==
          "--virtual_local_rank: local rank 2 has no device in CUDA_VISIBLE_DEVICES=3,5");
    CHECK(parse_ok({"--nproc_per_node=3", "prog"}, h, env).nproc_per_node == 3);  // only when asked
  }
}

TEST_CASE("flags: --duplicate_{stdout,stderr}_filters: comma lists, ,, for a comma", "[config]") {
  using muster::launcher::parse_filter_list;
  using V = std::vector<std::string>;
  CHECK(parse_filter_list("") == V{});
  CHECK(parse_filter_list("apple,orange") == V{"apple", "orange"});
  CHECK(parse_filter_list("a,,b,c") == V{"a,b", "c"});
  CHECK(parse_filter_list(",x,,") == V{"x,"});
  CHECK(parse_filter_list("loss: , step") == V{"loss: ", " step"});  // kept as given
  auto c = parse_ok({"--duplicate-stdout-filters", "apple,orange", "--duplicate_stderr_filters=E",
                     "prog"});
  CHECK(c.duplicate_stdout_filters == V{"apple", "orange"});
  CHECK(c.duplicate_stderr_filters == V{"E"});
  CHECK(parse_ok({"prog"}).duplicate_stdout_filters.empty());
  {
    ScopedEnv env(std::map<std::string, std::string>{{"PET_DUPLICATE_STDOUT_FILTERS", "x"}});
    CHECK(parse_ok({"prog"}).duplicate_stdout_filters == V{"x"});
  }
  // --log_dir=/dev/null writes no files, the filtered copies included.
  CHECK(parse_ok({"--log_dir=/dev/null", "--duplicate_stdout_filters=x", "prog"})
            .duplicate_stdout_filters.empty());
}

TEST_CASE("flags: --numa_binding takes torchrun's modes", "[config]") {
  CHECK(parse_ok({"prog"}).numa_binding.empty());
  for (const std::string m : {"node", "socket", "exclusive", "core-complex"}) {
    CHECK(parse_ok({"--numa-binding", m, "prog"}).numa_binding == m);
    CHECK(parse_ok({"--numa_binding=" + m, "prog"}).numa_binding == m);
  }
  {
    ScopedEnv env(std::map<std::string, std::string>{{"PET_NUMA_BINDING", "socket"}});
    CHECK(parse_ok({"prog"}).numa_binding == "socket");
  }
  CHECK(parse_err({"--numa-binding=numa", "prog"}) ==
        "--numa_binding: 'numa' is not a mode (node, socket, exclusive, core-complex)");
  CHECK(parse_err({"--numa-binding=", "prog"}) ==
        "--numa_binding: '' is not a mode (node, socket, exclusive, core-complex)");
}

TEST_CASE("flags: --help shows the torchrun 2.x flags in their groups", "[config]") {
  auto r = parse_launch_args({"--help"}, fake_host(1, 0));
  const std::string& h = r.help;
  const auto workers = h.find("Workers:");
  const auto logs = h.find("Logs and output:");
  REQUIRE(workers != std::string::npos);
  REQUIRE(logs != std::string::npos);
  // The flag is listed after the group's heading and before the next heading ("\n\nName:").
  auto in_group = [&](const std::string& flag, std::size_t group) {
    const auto at = h.find(flag, group);
    const auto next = h.find(":\n", h.find('\n', group));
    return at != std::string::npos && (next == std::string::npos || at < next);
  };
  CHECK(in_group("--virtual_local_rank", workers));
  CHECK(in_group("--numa_binding", workers));
  CHECK(in_group("--duplicate_stdout_filters", logs));
  CHECK(in_group("--duplicate_stderr_filters", logs));
  CHECK(in_group("--log_line_prefix_template", logs));
  CHECK(in_group("--local_ranks_filter", logs));
  CHECK(in_group("--shutdown_timeout", workers));
  CHECK(in_group("--signals_to_handle", workers));
}

TEST_CASE("flags: --legacy_launch gives the program --local-rank=N unless --use_env",
          "[config]") {
  muster::testing::TempDir dir;
  const std::string exe = dir.file("tool");
  std::ofstream(exe) << "#!/bin/sh\n";
  ::chmod(exe.c_str(), 0755);
  std::map<std::string, std::string> env{{"PATH", dir.path()}};
  auto argv = [&](const std::vector<std::string>& args) {
    auto e = muster::launcher::resolve_entrypoint(parse_ok(args), env);
    REQUIRE(e.ok());
    return e->argv;
  };
  // torch 2.x's torch.distributed.launch spelling, first after the program, before its own
  // arguments; the agent puts the local rank in place of the macro.
  CHECK(argv({"--legacy_launch", "--nproc_per_node=2", exe, "--lr", "1"}) ==
        std::vector<std::string>{exe, "--local-rank=${local_rank}", "--lr", "1"});
  CHECK(argv({"--legacy-launch", "--use_env", exe, "a"}) == std::vector<std::string>{exe, "a"});
  CHECK(argv({"--legacy-launch", "--use-env", exe, "a"}) == std::vector<std::string>{exe, "a"});
  // torchrun (no --legacy_launch) never passes it; --use_env is accepted and changes nothing.
  CHECK(argv({"--use_env", exe, "a"}) == std::vector<std::string>{exe, "a"});
  CHECK(argv({exe, "a"}) == std::vector<std::string>{exe, "a"});
  // The static flags as torch.distributed.launch has them (its defaults are torchrun's).
  LaunchConfig c = parse_ok({"--legacy_launch", "--nnodes=2", "--node_rank=1",
                             "--master_addr=10.0.0.1", "--master_port=1234", "p"});
  CHECK(c.node_rank == 1);
  CHECK(c.master_addr == "10.0.0.1");
  CHECK(c.master_port == 1234);
  CHECK(c.mode == muster::launcher::RdzvMode::kStatic);
  LaunchConfig d = parse_ok({"--legacy_launch", "--master_port=29500", "p"});
  CHECK(d.master_addr == "127.0.0.1");
  CHECK(d.master_port == 29500);
  CHECK(d.node_rank == 0);
  // torch.distributed.launch goes through torchrun's run(): one node and no port is standalone.
  CHECK(parse_ok({"--legacy_launch", "p"}).standalone);
}

TEST_CASE("flags: --metrics_port is off by default, 0..65535, either spelling", "[config]") {
  CHECK(parse_ok({"--standalone", "prog"}).metrics_port == -1);
  CHECK(parse_ok({"--standalone", "--metrics_port=0", "prog"}).metrics_port == 0);
  CHECK(parse_ok({"--standalone", "--metrics-port", "9400", "prog"}).metrics_port == 9400);
  CHECK_THAT(parse_err({"--standalone", "--metrics_port=70000", "prog"}),
             Catch::Contains("metrics_port"));
  CHECK_THAT(parse_err({"--standalone", "--metrics_port=-1", "prog"}),
             Catch::Contains("metrics_port"));
}

TEST_CASE("rendezvous flags: an endpoint list and reattach_timeout", "[config]") {
  using muster::launcher::parse_endpoints;
  auto list = parse_endpoints("a:1, b ,[::1]:3", 29400);
  REQUIRE(list.ok());
  REQUIRE(list->size() == 3);
  CHECK((*list)[0].to_string() == "a:1");
  CHECK((*list)[1].to_string() == "b:29400");
  CHECK((*list)[2].to_string() == "[::1]:3");
  CHECK(parse_endpoints("a:0", 29400).ok());  // one endpoint: port 0 is the caller's to judge
  for (const char* bad : {"a:1,,b:2", "a:1,", "a:0,b:1", "a:1,b:x"}) {
    INFO(bad);
    CHECK_FALSE(parse_endpoints(bad, 29400).ok());
  }
  std::string many = "h:1";
  for (std::size_t i = 1; i <= muster::rendezvous::limits::kMaxRdzvEndpoints; ++i) many += ",h:1";
  CHECK_THAT(std::string(parse_endpoints(many, 29400).status().message()),
             Catch::Contains("more than the limit"));
  // The first is the endpoint (the hosting rule looks at it); the rest follow.
  LaunchConfig c = parse_ok({"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=n0:1,n1:2",
                             "--rdzv_conf=reattach_timeout=7.5", "p"});
  CHECK(c.endpoint.to_string() == "n0:1");
  REQUIRE(c.more_endpoints.size() == 1);
  CHECK(c.more_endpoints[0].to_string() == "n1:2");
  CHECK(c.rdzv_conf.timeouts.reattach_timeout == std::chrono::milliseconds(7500));
  CHECK(muster::launcher::parse_rdzv_conf("").value().timeouts.reattach_timeout ==
        muster::rendezvous::limits::kDefaultReattachTimeout);
  CHECK_FALSE(muster::launcher::parse_rdzv_conf("reattach_timeout=0").ok());
  CHECK_FALSE(muster::launcher::parse_rdzv_conf("reattach_timeout=100000").ok());
}
