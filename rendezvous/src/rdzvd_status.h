// `rdzvd status`: the runs a rendezvous server holds, as a table or JSON
// (docs/operations.md, "Status").
#pragma once

#include <CLI/CLI.hpp>

#include "muster/ops/status_query.h"

namespace muster::rdzvd {

class StatusCommand {
 public:
  // Adds the `status` subcommand and its flags to `app`.
  explicit StatusCommand(CLI::App& app);
  // Whether the command line named it (after app.parse).
  bool parsed() const { return sub_->parsed(); }
  // Prints the status; the exit code (ops::print_status).
  int run() const;

 private:
  CLI::App* sub_;
  ops::StatusQuery query_;
};

}  // namespace muster::rdzvd
