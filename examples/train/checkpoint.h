// Training checkpoints: one file, `<dir>/checkpoint.bin`, replaced atomically (written to a
// temporary file in the same folder, fsync'd, renamed over the old one, folder fsync'd), so a
// reader sees either the previous checkpoint or the new one, never a torn file.
//
// Layout (little-endian): "MUSTERCK" | u32 version | u64 fingerprint length | fingerprint |
// i64 step | i64 adam_steps | f32 scale | i64 growth_tracker | u64 n | params[n] m[n] v[n]
// (f32) | u64 FNV-1a of everything before it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace muster::train {

struct Checkpoint {
  std::string fingerprint;  // the model and task it belongs to
  std::int64_t step = 0;    // the last completed step
  std::int64_t adam_steps = 0;
  float scale = 1.0f;
  std::int64_t growth_tracker = 0;
  std::vector<float> params, m, v;
};

absl::Status save_checkpoint(const std::string& dir, const Checkpoint& c);
// NOT_FOUND when there is none; DATA_LOSS when the file is damaged.
absl::StatusOr<Checkpoint> load_checkpoint(const std::string& dir);

}  // namespace muster::train
