// `launch status --rdzv_endpoint HOST:PORT [--rdzv_id ID] [--json]`: the runs the rendezvous
// server holds (docs/operations.md, "Status"). main() hands it argv when argv[1] is "status".
#pragma once

namespace muster::launcher {

// argv[0] is "status". The exit code: 0, 1 (server unreachable, token refused, unknown run)
// or 2 (usage).
int status_command(int argc, char** argv);

}  // namespace muster::launcher
