#include "rdzvd_status.h"

#include "absl/strings/str_cat.h"

namespace muster::rdzvd {

StatusCommand::StatusCommand(CLI::App& app) {
  sub_ = app.add_subcommand("status", "Show the runs a rendezvous server holds, then exit");
  query_.endpoint = absl::StrCat("127.0.0.1:", muster::status::kDefaultStatusPort);
  sub_->add_option("--endpoint", query_.endpoint, "HOST:PORT of the rendezvous server")
      ->capture_default_str();
  sub_->add_option("--run", query_.run_id, "Only this run (rdzv_id); an error if it is not held");
  sub_->add_flag("--json", query_.json, "One JSON document instead of the table");
  sub_->add_option("--token", query_.token, "The server's token (or $MUSTER_RDZV_TOKEN)")
      ->envname("MUSTER_RDZV_TOKEN");
  muster::status::add_status_tls_options(*sub_, query_);
}

int StatusCommand::run() const { return muster::status::print_status(query_, "rdzvd"); }

}  // namespace muster::rdzvd
