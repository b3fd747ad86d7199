// A real rdzvd on 127.0.0.1, port 0, for the status, event log and live page tests: the
// ports it got are read from what it prints first.
#pragma once

#include <signal.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "helpers.h"

namespace muster::testing {

struct RdzvdProc {
  std::unique_ptr<Proc> proc;
  std::string endpoint;  // 127.0.0.1:PORT of the gRPC server
  int page_port = 0;     // the live page's, when started with --http_port

  explicit RdzvdProc(std::vector<std::string> extra = {}) {
    std::vector<std::string> argv{kRdzvd, "--listen", "127.0.0.1:0"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const bool page = std::find(argv.begin(), argv.end(), "--http_port") != argv.end();
    proc = std::make_unique<Proc>(argv);
    REQUIRE(proc->wait_output(
        [page](const std::string& out, const std::string&) {
          return out.find("listening on port") != std::string::npos &&
                 (!page || out.find("page on port") != std::string::npos);
        },
        30s));
    std::smatch m;
    REQUIRE(std::regex_search(proc->out(), m, std::regex(R"(listening on port (\d+))")));
    endpoint = "127.0.0.1:" + m[1].str();
    if (page) {
      REQUIRE(std::regex_search(proc->out(), m, std::regex(R"(rdzvd page on port (\d+))")));
      page_port = std::stoi(m[1].str());
    }
  }
  ~RdzvdProc() {
    ::kill(proc->pid(), SIGTERM);
    CHECK(proc->wait(30s) == 0);
  }
};

// Flags of one c10d agent of run `id` on 127.0.0.1 (its node id is then "127.0.0.1:<pid>").
inline std::vector<std::string> agent_flags(const std::string& endpoint, const std::string& nnodes,
                                            int nproc, const std::string& id,
                                            std::vector<std::string> extra = {}) {
  std::vector<std::string> flags{"--nnodes=" + nnodes, "--nproc_per_node=" + std::to_string(nproc),
                                 "--rdzv_backend=c10d", "--rdzv_endpoint=" + endpoint,
                                 "--rdzv_id=" + id, "--local_addr=127.0.0.1"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

}  // namespace muster::testing
