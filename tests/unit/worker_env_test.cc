#include "muster/agent/worker_env.h"

#include <catch2/catch.hpp>

using muster::agent::build_worker_env;
using muster::agent::WorkerEnvSpec;

TEST_CASE("worker env: every contract variable, as torchrun computes it", "[env]") {
  WorkerEnvSpec s;
  s.local_rank = 2;
  s.local_world_size = 4;
  s.rank_offset = 8;
  s.world_size = 16;
  s.group_rank = 2;
  s.group_world_size = 4;
  s.role = "trainer";
  s.master_addr = "node0";
  s.master_port = 29501;
  s.restart_count = 1;
  s.max_restarts = 3;
  s.run_id = "job42";
  s.error_file = "/tmp/x/attempt_1/2/error.json";
  s.store_addr = "127.0.0.1:4000";
  s.round = 5;
  s.node_addr = "node2";
  s.token = "t0k";
  s.signals_to_handle = "SIGTERM,SIGUSR1";
  auto env = build_worker_env({{"PATH", "/bin"}, {"RANK", "stale"}}, s);
  const std::map<std::string, std::string> expected{
      {"PATH", "/bin"},
      {"RANK", "10"},
      {"LOCAL_RANK", "2"},
      {"WORLD_SIZE", "16"},
      {"LOCAL_WORLD_SIZE", "4"},
      {"GROUP_RANK", "2"},
      {"GROUP_WORLD_SIZE", "4"},
      {"ROLE_RANK", "10"},
      {"ROLE_NAME", "trainer"},
      {"ROLE_WORLD_SIZE", "16"},
      {"MASTER_ADDR", "node0"},
      {"MASTER_PORT", "29501"},
      {"TORCHELASTIC_RESTART_COUNT", "1"},
      {"TORCHELASTIC_MAX_RESTARTS", "3"},
      {"TORCHELASTIC_RUN_ID", "job42"},
      {"TORCHELASTIC_USE_AGENT_STORE", "False"},
      {"TORCHELASTIC_ERROR_FILE", "/tmp/x/attempt_1/2/error.json"},
      {"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR1"},
      {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"},
      {"OMP_NUM_THREADS", "1"},
      {"MUSTER_STORE_ADDR", "127.0.0.1:4000"},
      {"MUSTER_RUN_ID", "job42"},
      {"MUSTER_ROUND", "5"},
      {"MUSTER_NODE_ADDR", "node2"},
      {"MUSTER_RDZV_TOKEN", "t0k"},
  };
  CHECK(env == expected);
}

TEST_CASE("worker env: the run's store on MASTER_PORT is TORCHELASTIC_USE_AGENT_STORE=True",
          "[env]") {
  WorkerEnvSpec s;
  s.master_addr = "rdzv";
  s.master_port = 41000;
  s.use_agent_store = true;
  auto env = build_worker_env({}, s);
  CHECK(env["TORCHELASTIC_USE_AGENT_STORE"] == "True");
  CHECK(env["MASTER_ADDR"] == "rdzv");
  CHECK(env["MASTER_PORT"] == "41000");
  s.use_agent_store = false;
  CHECK(build_worker_env({}, s)["TORCHELASTIC_USE_AGENT_STORE"] == "False");
}

TEST_CASE("worker env: user settings of the if-unset variables are kept", "[env]") {
  WorkerEnvSpec s;
  s.local_world_size = 4;
  auto env =
      build_worker_env({{"OMP_NUM_THREADS", "7"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"}}, s);
  CHECK(env["OMP_NUM_THREADS"] == "7");
  CHECK(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0");
}

TEST_CASE("worker env: a single worker gets no OMP_NUM_THREADS", "[env]") {
  WorkerEnvSpec s;
  s.local_world_size = 1;
  auto env = build_worker_env({}, s);
  CHECK(env.count("OMP_NUM_THREADS") == 0);
}

TEST_CASE("worker env: envp strings", "[env]") {
  CHECK(muster::agent::to_envp({{"A", "1"}, {"B", "x=y"}}) ==
        std::vector<std::string>{"A=1", "B=x=y"});
}

TEST_CASE("worker env: the store's Unix socket only for workers with the server's host identity",
          "[env]") {
  using muster::agent::store_target_for_workers;
  const std::string local = "unix-abstract:muster-rdzv-1-2", tcp = "10.0.0.1:29400";
  const std::string here = "boot-a net:[1]";
  CHECK(store_target_for_workers(local, here, here, tcp) == local);
  CHECK(store_target_for_workers(local, "boot-b net:[1]", here, tcp) == tcp);  // another machine
  CHECK(store_target_for_workers(local, "boot-a net:[2]", here, tcp) == tcp);  // another namespace
  CHECK(store_target_for_workers("", here, here, tcp) == tcp);                 // no local socket
  CHECK(store_target_for_workers(local, "", "", tcp) == tcp);                  // identity unknown
}

TEST_CASE("worker env: TORCHELASTIC_SIGNALS_TO_HANDLE defaults to torchrun's signals", "[env]") {
  auto env = build_worker_env({{"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGUSR2"}}, WorkerEnvSpec{});
  CHECK(env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT");
}

TEST_CASE("worker env: --virtual_local_rank: LOCAL_RANK 0, one device, as torchrun", "[env]") {
  WorkerEnvSpec s;
  s.local_rank = 2;
  s.local_world_size = 4;
  s.rank_offset = 4;
  s.virtual_local_rank = true;
  SECTION("launch has no CUDA_VISIBLE_DEVICES: the local rank's device") {
    auto env = build_worker_env({}, s);
    CHECK(env["LOCAL_RANK"] == "0");
    CHECK(env["RANK"] == "6");
    CHECK(env["CUDA_VISIBLE_DEVICES"] == "2");
  }
  SECTION("launch's CUDA_VISIBLE_DEVICES: the entry at the local rank's position, trimmed") {
    auto env = build_worker_env({{"CUDA_VISIBLE_DEVICES", "4,5, 7 ,GPU-abc"}}, s);
    CHECK(env["LOCAL_RANK"] == "0");
    CHECK(env["CUDA_VISIBLE_DEVICES"] == "7");
    s.local_rank = 3;
    CHECK(build_worker_env({{"CUDA_VISIBLE_DEVICES", "4,5,7,GPU-abc"}}, s)["CUDA_VISIBLE_DEVICES"] ==
          "GPU-abc");
  }
  SECTION("off: LOCAL_RANK is the local rank and CUDA_VISIBLE_DEVICES is inherited") {
    s.virtual_local_rank = false;
    auto env = build_worker_env({{"CUDA_VISIBLE_DEVICES", "4,5,7,8"}}, s);
    CHECK(env["LOCAL_RANK"] == "2");
    CHECK(env["CUDA_VISIBLE_DEVICES"] == "4,5,7,8");
    CHECK(build_worker_env({}, s).count("CUDA_VISIBLE_DEVICES") == 0);
  }
}

TEST_CASE("worker env: virtual_visible_device refuses a local rank past the list", "[env]") {
  using muster::agent::virtual_visible_device;
  const std::string two = "0,1";
  CHECK(*virtual_visible_device(&two, 1) == "1");
  auto past = virtual_visible_device(&two, 2);
  REQUIRE_FALSE(past.ok());
  CHECK(std::string(past.status().message()) ==
        "--virtual_local_rank: local rank 2 has no device in CUDA_VISIBLE_DEVICES=0,1");
  CHECK(*virtual_visible_device(nullptr, 5) == "5");
  const std::string empty;
  CHECK(*virtual_visible_device(&empty, 0) == "");  // torchrun: "".split(",") == [""]
  CHECK_FALSE(virtual_visible_device(&empty, 1).ok());
}

TEST_CASE("worker args: torchrun's ${local_rank} macro, as string.Template substitutes it",
          "[env]") {
  using muster::agent::substitute_local_rank;
  CHECK(substitute_local_rank("--local-rank=${local_rank}", 3) == "--local-rank=3");
  CHECK(substitute_local_rank("out_$local_rank.log", 1) == "out_1.log");
  CHECK(substitute_local_rank("$local_rank", 0) == "0");
  CHECK(substitute_local_rank("a$$b", 2) == "a$b");
  CHECK(substitute_local_rank("$HOME ${rank} $", 2) == "$HOME ${rank} $");
  CHECK(substitute_local_rank("$local_ranks", 2) == "$local_ranks");  // another name
  CHECK(substitute_local_rank("${local_rank", 2) == "${local_rank");
  CHECK(substitute_local_rank("plain", 2) == "plain");
}

TEST_CASE("worker env: torchrun's variables from launch's environment reach workers as given",
          "[env]") {
  // torchrun's workers inherit its environment (subprocess_handler: os.environ, then the
  // worker's own); the timer's variables and the device list are passed on, and an empty
  // TORCH_NCCL_ASYNC_ERROR_HANDLING stays empty (torch's os.getenv(name, "1")).
  const std::map<std::string, std::string> base{
      {"TORCHELASTIC_ENABLE_FILE_TIMER", "1"},
      {"TORCHELASTIC_TIMER_FILE", "/tmp/job/watchdog_timer"},
      {"CUDA_VISIBLE_DEVICES", "3,1"},
      {"TORCH_NCCL_ASYNC_ERROR_HANDLING", ""},
      {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${rank}]"}};
  WorkerEnvSpec s;
  s.local_world_size = 2;
  auto env = build_worker_env(base, s);
  for (const auto& [k, v] : base) {
    INFO(k);
    REQUIRE(env.count(k) == 1);
    CHECK(env.at(k) == v);
  }
  CHECK(env.count("NCCL_ASYNC_ERROR_HANDLING") == 0);  // torch 1.x's name: torchrun 2.x sets none
}
