// Worker failures: reading torch's error file and printing torchrun's failure summary.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "muster/v1/rendezvous.pb.h"

namespace muster::agent {

// Fills `f.message` and `f.traceback` from the worker's TORCHELASTIC_ERROR_FILE when it wrote
// one in torch's @record format:
//   {"message": {"message": "ValueError: x", "extraInfo": {"py_callstack": "...", ...}}}
// or {"message": "text"}. Leaves `f` as it was when the file is absent or unreadable.
// Bounded whatever the worker wrote: at most limits::kMaxErrorFileReadBytes are read (a
// document cut there still yields what it holds), the message keeps its first and the
// traceback its last limits::kMaxFailure{Message,Traceback}Bytes (a note inside the bound
// says how much was cut), and invalid UTF-8 and control characters become U+FFFD.
void read_error_file(const std::string& path, v1::WorkerFailure& f);

// torch's @record JSON for a failure, as torchrun writes its own error file when a worker
// failed: {"message": {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp": ...},
// "errorCode": <exit code, or -signal>}}.
std::string error_file_json(const v1::WorkerFailure& f);

// torch's record of a SignalException, as torchrun's @record main writes it to its own
// TORCHELASTIC_ERROR_FILE when a signal stopped it:
//   {"message": {"message": "SignalException: Process <pid> got signal: <sig>",
//                "extraInfo": {"py_callstack": ..., "timestamp": "<seconds>"}}}
// (no errorCode: torch's record_exception writes none).
std::string signal_exception_json(int sig, long pid, std::int64_t timestamp_s);
// Writes that record for this process, now, to `path` (launch's own TORCHELASTIC_ERROR_FILE).
void write_signal_exception(const std::string& path, int sig);

// When `text` (a worker's error message and traceback, or the end of its stderr) shows
// Python's ModuleNotFoundError, the note launch adds after the failure summary: which
// interpreter ran the worker (`interpreter`, with why it was chosen) and how to choose
// another (PYTHON_EXEC). Empty when `text` shows no ModuleNotFoundError.
std::string module_not_found_hint(std::string_view text, int rank, std::string_view interpreter);

// "SIGKILL" for 9; "signal 70" for numbers without a name.
std::string signal_name(int sig);

// torchrun's ChildFailedError text, root cause first:
//   ============================================================
//   <entrypoint> FAILED
//   ------------------------------------------------------------
//   Failures:
//     <NO_OTHER_FAILURES>
//   ------------------------------------------------------------
//   Root Cause (first observed failure):
//   [0]:
//     time      : 2026-11-30_02:00:00
//     host      : node0
//     rank      : 3 (local_rank: 1)
//     exitcode  : -9 (pid: 1234)   <- minus the signal number when killed by one
//     error_file: <N/A>
//     traceback : Signal 9 (SIGKILL) received by PID 1234
//   ============================================================
std::string format_failure_summary(std::string_view entrypoint, const v1::WorkerFailure& root,
                                   const std::vector<v1::WorkerFailure>& others);

}  // namespace muster::agent
