#include <cmath>
#include <limits>

#include <catch2/catch.hpp>

#include "muster/worker/half.h"
#include "muster/worker/runtime.h"

using namespace muster::worker;

namespace {
std::map<std::string, std::string> good_env() {
  return {{"RANK", "5"}, {"LOCAL_RANK", "1"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"},
          {"GROUP_RANK", "1"}, {"GROUP_WORLD_SIZE", "2"}, {"ROLE_RANK", "5"},
          {"ROLE_WORLD_SIZE", "8"}, {"ROLE_NAME", "default"}, {"MASTER_ADDR", "node0"},
          {"MASTER_PORT", "29500"}, {"TORCHELASTIC_RESTART_COUNT", "2"},
          {"TORCHELASTIC_MAX_RESTARTS", "3"}, {"TORCHELASTIC_RUN_ID", "job"},
          {"MUSTER_STORE_ADDR", "node0:29400"}, {"MUSTER_RUN_ID", "job"}, {"MUSTER_ROUND", "4"},
          {"MUSTER_NODE_ADDR", "node1"}};
}
}  // namespace

TEST_CASE("runtime: every variable of the worker environment is read", "[runtime]") {
  auto w = parse_worker_env(good_env());
  REQUIRE(w.ok());
  CHECK(w->rank == 5);
  CHECK(w->local_rank == 1);
  CHECK(w->world_size == 8);
  CHECK(w->local_world_size == 4);
  CHECK(w->group_rank == 1);
  CHECK(w->group_world_size == 2);
  CHECK(w->role_rank == 5);
  CHECK(w->role_world_size == 8);
  CHECK(w->role_name == "default");
  CHECK(w->master_addr == "node0");
  CHECK(w->master_port == 29500);
  CHECK(w->restart_count == 2);
  CHECK(w->max_restarts == 3);
  CHECK(w->run_id == "job");
  CHECK(w->store_addr == "node0:29400");
  CHECK(w->store_run_id == "job");
  CHECK(w->round == 4);
  CHECK(w->node_addr == "node1");
  CHECK(w->token.empty());
}

TEST_CASE("runtime: a missing or malformed variable is named", "[runtime]") {
  for (const char* key : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MUSTER_STORE_ADDR",
                          "MUSTER_ROUND", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"}) {
    auto env = good_env();
    env.erase(key);
    auto w = parse_worker_env(env);
    INFO(key);
    REQUIRE_FALSE(w.ok());
    CHECK_THAT(std::string(w.status().message()), Catch::Contains(std::string(key) + " is not set"));
  }
  auto env = good_env();
  env["WORLD_SIZE"] = "eight";
  CHECK_THAT(std::string(parse_worker_env(env).status().message()),
             Catch::Contains("WORLD_SIZE='eight' is not an integer"));
  env = good_env();
  env["RANK"] = "8";
  CHECK_THAT(std::string(parse_worker_env(env).status().message()),
             Catch::Contains("RANK=8 is not below WORLD_SIZE=8"));
  env = good_env();
  env["MASTER_PORT"] = "70000";
  CHECK_FALSE(parse_worker_env(env).ok());
}

TEST_CASE("runtime: LOCAL_WORLD_SIZE above WORLD_SIZE names the value it was given",
          "[runtime]") {
  auto env = good_env();
  env["LOCAL_WORLD_SIZE"] = "4";
  env["WORLD_SIZE"] = "1";
  env["RANK"] = "0";
  env["LOCAL_RANK"] = "0";
  env["ROLE_RANK"] = "0";
  env["ROLE_WORLD_SIZE"] = "1";
  auto w = parse_worker_env(env);
  REQUIRE_FALSE(w.ok());
  const std::string msg(w.status().message());
  CHECK_THAT(msg, Catch::Contains("LOCAL_WORLD_SIZE=4"));
  CHECK_THAT(msg, Catch::Contains("WORLD_SIZE=1"));
  CHECK_THAT(msg, !Catch::Contains("LOCAL_WORLD_SIZE=3"));
}

TEST_CASE("half: bf16 rounds to nearest even", "[half]") {
  CHECK(f32_to_bf16(1.0f) == 0x3f80);
  CHECK(bf16_to_f32(0x3f80) == 1.0f);
  // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties go to even (1.0).
  CHECK(f32_to_bf16(1.00390625f) == 0x3f80);
  // 1.0078125 + 2^-8 is halfway between 1.0078125 (odd) and 1.015625: goes up to even.
  CHECK(f32_to_bf16(1.01171875f) == 0x3f82);
  CHECK(f32_to_bf16(1.005f) == 0x3f81);
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::infinity()))));
  for (int i = -300; i <= 300; ++i) CHECK(bf16_to_f32(f32_to_bf16(static_cast<float>(i))) == std::nearbyint(i / (std::abs(i) > 256 ? 2.0 : 1.0)) * (std::abs(i) > 256 ? 2.0 : 1.0));
}

TEST_CASE("half: f16 round trips, subnormals, overflow", "[half]") {
  CHECK(f32_to_f16(1.0f) == 0x3c00);
  CHECK(f16_to_f32(0x3c00) == 1.0f);
  CHECK(f16_to_f32(f32_to_f16(65504.0f)) == 65504.0f);
  CHECK(std::isinf(f16_to_f32(f32_to_f16(65536.0f))));
  CHECK(f16_to_f32(0x0001) == std::ldexp(1.0f, -24));  // smallest subnormal
  CHECK(f32_to_f16(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(f32_to_f16(std::ldexp(1.0f, -26)) == 0x0000);  // rounds to zero
  CHECK(f32_to_f16(-2.0f) == 0xc000);
  // Every f16 value converts to f32 and back unchanged.
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0) continue;  // NaNs
    REQUIRE(f32_to_f16(f16_to_f32(static_cast<std::uint16_t>(h))) == h);
  }
  // Ties to even: 1 + 2^-11 is halfway between 1.0 and 1 + 2^-10.
  CHECK(f32_to_f16(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);
  CHECK(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);
}
