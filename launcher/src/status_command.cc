#include "status_command.h"

#include <CLI/CLI.hpp>
#include <cstdio>

#include "muster/status/status_query.h"

namespace muster::launcher {

int status_command(int argc, char** argv) {
  muster::status::StatusQuery q;
  CLI::App app{"launch status: the runs a rendezvous server holds, as a table or JSON",
               "launch status"};
  app.add_option("--rdzv_endpoint,--rdzv-endpoint", q.endpoint,
                 "HOST[:PORT] of the rendezvous server (or $PET_RDZV_ENDPOINT)")
      ->envname("PET_RDZV_ENDPOINT")
      ->required();
  app.add_option("--rdzv_id,--rdzv-id", q.run_id,
                 "Only this run; an error if it is not held (or $PET_RDZV_ID)")
      ->envname("PET_RDZV_ID");
  app.add_flag("--json", q.json, "One JSON document instead of the table");
  app.add_option("--token", q.token, "The server's token (or $MUSTER_RDZV_TOKEN)")
      ->envname("MUSTER_RDZV_TOKEN");
  muster::status::add_status_tls_options(app, q);
  try {
    app.parse(argc, argv);  // CLI11 skips argv[0], "status" here
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "launch: error: %s\n", e.what());
    return 2;
  }
  return muster::status::print_status(q, "launch");
}

}  // namespace muster::launcher
