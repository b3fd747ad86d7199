// A real rdzvd on 127.0.0.1, port 0, for the integration tests: the ports it got (gRPC, and
// the live page's and the metrics' when asked for) are read from what it prints first; it is
// ended by SIGTERM (exit 0) by the destructor.
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
  int metrics_port = 0;  // /metrics', when started with --metrics_port

  explicit RdzvdProc(std::vector<std::string> extra = {}) {
    std::vector<std::string> argv{kRdzvd, "--listen", "127.0.0.1:0"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto given = [&argv](const char* flag) {
      return std::find(argv.begin(), argv.end(), flag) != argv.end();
    };
    const bool page = given("--http_port"), metrics = given("--metrics_port");
    proc = std::make_unique<Proc>(argv);
    auto line = [](const std::string& out, const char* what) {
      const auto at = out.find(what);
      return at != std::string::npos && out.find('\n', at) != std::string::npos;
    };
    REQUIRE(proc->wait_output(
        [&](const std::string& out, const std::string&) {
          return line(out, "listening on port") && (!page || line(out, "page on port")) &&
                 (!metrics || line(out, "metrics on port"));
        },
        30s));
    endpoint = "127.0.0.1:" + std::to_string(port_after("listening on port"));
    if (page) page_port = port_after("rdzvd page on port");
    if (metrics) metrics_port = port_after("rdzvd metrics on port");
  }
  ~RdzvdProc() {
    ::kill(proc->pid(), SIGTERM);
    CHECK(proc->wait(30s) == 0);
  }

 private:
  int port_after(const std::string& what) const {
    std::smatch m;
    const std::string out = proc->out();
    REQUIRE(std::regex_search(out, m, std::regex(what + R"( (\d+))")));
    return std::stoi(m[1].str());
  }
};

// Flags of one c10d agent of run `id` (then `extra`).
inline std::vector<std::string> c10d(const std::string& endpoint, const std::string& nnodes,
                                     int nproc, const std::string& id,
                                     std::vector<std::string> extra = {}) {
  std::vector<std::string> flags{"--nnodes=" + nnodes, "--nproc_per_node=" + std::to_string(nproc),
                                 "--rdzv_backend=c10d", "--rdzv_endpoint=" + endpoint,
                                 "--rdzv_id=" + id};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

// The same on 127.0.0.1 (its node id is then "127.0.0.1:<pid>").
inline std::vector<std::string> agent_flags(const std::string& endpoint, const std::string& nnodes,
                                            int nproc, const std::string& id,
                                            std::vector<std::string> extra = {}) {
  extra.insert(extra.begin(), "--local_addr=127.0.0.1");
  return c10d(endpoint, nnodes, nproc, id, std::move(extra));
}

}  // namespace muster::testing
