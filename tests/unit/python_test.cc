// Which interpreter runs a Python worker (launcher/python.h), with fake interpreters: tiny
// shell scripts on a fake PATH that answer the torch probe yes, no, or never.
#include "muster/launcher/python.h"

#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>

#include "muster/agent/failure.h"
#include "muster/launcher/config.h"
#include "proc.h"

using muster::launcher::can_import_torch;
using muster::launcher::choose_python;
using muster::launcher::TorchProbe;
using namespace std::chrono_literals;

namespace {

void write_file(const std::string& path, const std::string& text, mode_t mode = 0644) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << text;
  ::chmod(path.c_str(), mode);
}

// A fake python3 in `dir` whose torch probe exits `code` (after `delay` seconds).
std::string fake_python(const std::string& dir, int code, int delay = 0) {
  const std::string p = dir + "/python3";
  write_file(p, "#!/bin/sh\n" + (delay > 0 ? "sleep " + std::to_string(delay) + "\n" : "") +
                    "exit " + std::to_string(code) + "\n",
             0755);
  return p;
}

}  // namespace

TEST_CASE("python: the torch probe asks the interpreter, bounded in time", "[python]") {
  muster::testing::TempDir dir;
  CHECK(can_import_torch(fake_python(dir.file("yes"), 0), 5s));
  CHECK_FALSE(can_import_torch(fake_python(dir.file("no"), 1), 5s));
  CHECK_FALSE(can_import_torch(dir.file("missing/python3"), 5s));
  const auto start = std::chrono::steady_clock::now();
  CHECK_FALSE(can_import_torch(fake_python(dir.file("slow"), 0, 30), 200ms));
  CHECK(std::chrono::steady_clock::now() - start < muster::testing::scaled(5s));  // killed at the bound, not waited for
}

TEST_CASE("python: a cheap scan tells whether a script imports torch", "[python]") {
  muster::testing::TempDir dir;
  auto imports = [&](const std::string& text) {
    write_file(dir.file("s.py"), text);
    return muster::launcher::script_imports_torch(dir.file("s.py"));
  };
  CHECK(imports("import torch\n"));
  CHECK(imports("import os\nimport torch.distributed as dist\n"));
  CHECK(imports("from torch.nn.parallel import DistributedDataParallel\n"));
  CHECK(imports("import os, torch\n"));
  CHECK(imports("if True:\n    import torch\n"));
  CHECK(imports("import sys; import torch\n"));
  CHECK_FALSE(imports("print('import torch')\n"));
  CHECK_FALSE(imports("import torchvision_like_name_only\n"));
  CHECK_FALSE(imports("import numpy\n# torch is not used\n"));
  CHECK_FALSE(muster::launcher::script_imports_torch(dir.file("missing.py")));

  write_file(dir.file("pkg/train.py"), "import torch\n");
  write_file(dir.file("app/__main__.py"), "print(1)\n");
  CHECK(muster::launcher::module_source("pkg.train", dir.path()) == dir.file("pkg/train.py"));
  CHECK(muster::launcher::module_source("app", dir.path()) == dir.file("app/__main__.py"));
  CHECK(muster::launcher::module_source("installed.mod", dir.path()).empty());
}

TEST_CASE("python: PYTHON_EXEC, then VIRTUAL_ENV, then a python3 with torch, then python3",
          "[python]") {
  muster::testing::TempDir dir;
  const std::string without = fake_python(dir.file("a"), 1);  // first on PATH, no torch
  const std::string with = fake_python(dir.file("b"), 0);
  // The same interpreter again through a symlink: asked once.
  std::filesystem::create_directories(dir.file("c"));
  std::filesystem::create_symlink(without, dir.file("c/python3"));
  std::map<std::string, std::string> env{
      {"PATH", dir.file("a") + ":" + dir.file("c") + ":" + dir.file("b")}};
  int probes = 0;
  TorchProbe counting = [&probes](const std::string& p, std::chrono::milliseconds t) {
    ++probes;
    return can_import_torch(p, t);
  };

  auto torch_script = choose_python(env, true, counting, 5s);
  REQUIRE(torch_script.ok());
  CHECK(torch_script->path == with);
  CHECK(torch_script->reason == "the first python3 on PATH that can import torch");
  CHECK(probes == 2);  // a, then b; c is a again

  probes = 0;
  auto plain = choose_python(env, false, counting, 5s);
  REQUIRE(plain.ok());
  CHECK(plain->path == without);
  CHECK(plain->reason == "python3 from PATH");
  CHECK(probes == 0);  // no probe for a script that does not import torch

  // Nobody can import torch, or the budget is spent: python3 from PATH, as before.
  std::map<std::string, std::string> none{{"PATH", dir.file("a")}};
  auto fallback = choose_python(none, true, counting, 5s);
  REQUIRE(fallback.ok());
  CHECK(fallback->path == without);
  probes = 0;
  auto no_budget = choose_python(env, true, counting, 0ms);
  REQUIRE(no_budget.ok());
  CHECK(no_budget->path == without);
  CHECK(probes == 0);

  // An active virtual environment wins over PATH (its python is never probed).
  write_file(dir.file("venv/bin/python"), "#!/bin/sh\nexit 1\n", 0755);
  env["VIRTUAL_ENV"] = dir.file("venv");
  auto venv = choose_python(env, true, counting, 5s);
  REQUIRE(venv.ok());
  CHECK(venv->path == dir.file("venv/bin/python"));
  CHECK_THAT(venv->reason, Catch::Contains("VIRTUAL_ENV"));
  // A VIRTUAL_ENV without an interpreter (a stale variable) is passed over.
  env["VIRTUAL_ENV"] = dir.file("gone");
  CHECK(choose_python(env, true, counting, 5s)->path == with);

  // PYTHON_EXEC wins over everything, a name or a path; one that names nothing is an error.
  env["VIRTUAL_ENV"] = dir.file("venv");
  env["PYTHON_EXEC"] = without;
  CHECK(choose_python(env, true, counting, 5s)->path == without);
  CHECK(choose_python(env, true, counting, 5s)->reason == "PYTHON_EXEC");
  env["PYTHON_EXEC"] = "python3";
  CHECK(choose_python(env, true, counting, 5s)->path == without);
  env["PYTHON_EXEC"] = dir.file("nope/python");
  auto bad = choose_python(env, true, counting, 5s);
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()), Catch::Contains("PYTHON_EXEC"));
}

TEST_CASE("python: resolve_entrypoint runs a torch script under a python3 that has torch",
          "[python]") {
  muster::testing::TempDir dir;
  fake_python(dir.file("a"), 1);
  const std::string with = fake_python(dir.file("b"), 0);
  write_file(dir.file("train.py"), "import torch\nprint(torch.__version__)\n");
  std::map<std::string, std::string> env{{"PATH", dir.file("a") + ":" + dir.file("b")}};
  auto cfg = muster::launcher::parse_launch_args({"--standalone", dir.file("train.py"), "x"},
                                                 muster::launcher::HostInfo{});
  REQUIRE(cfg.config.has_value());
  auto e = muster::launcher::resolve_entrypoint(*cfg.config, env);
  REQUIRE(e.ok());
  CHECK(e->path == with);
  CHECK(e->argv == std::vector<std::string>{with, "-u", dir.file("train.py"), "x"});
  CHECK(e->python_reason == "the first python3 on PATH that can import torch");
}

TEST_CASE("python: a ModuleNotFoundError gets a hint naming the interpreter", "[python]") {
  using muster::agent::module_not_found_hint;
  const std::string tail =
      "Traceback (most recent call last):\n  File \"t.py\", line 1, in <module>\n"
      "    import torch\nModuleNotFoundError: No module named 'torch'\n";
  const std::string h = module_not_found_hint(tail, 3, "/usr/bin/python3 (python3 from PATH)");
  CHECK_THAT(h, Catch::Contains("worker rank 3 failed with ModuleNotFoundError: No module named "
                                "'torch'\n"));
  CHECK_THAT(h, Catch::Contains("/usr/bin/python3 (python3 from PATH)"));
  CHECK_THAT(h, Catch::Contains("PYTHON_EXEC"));
  CHECK(module_not_found_hint("ValueError: x\n", 0, "p").empty());
  CHECK(module_not_found_hint("", 0, "p").empty());
}
