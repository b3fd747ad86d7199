// `rdzvd status`: the runs a rendezvous server holds, as a table or JSON
// (docs/operations.md, "Status").
#pragma once

#include <CLI/CLI.hpp>

#include "muster/status/status_query.h"

namespace muster::rdzvd {

class StatusCommand {
 public:
  // Adds the `status` subcommand and its flags to `app`.
  explicit StatusCommand(CLI::App& app);
  // Whether the command line named it (after app.parse).
  bool parsed() const { return sub_->parsed(); }
  // Prints the status; the exit code (muster::status::print_status).
  int run() const;

 private:
  CLI::App* sub_;
  muster::status::StatusQuery query_;
};

}  // namespace muster::rdzvd
