#include "server/memory_trim.h"

#include <malloc.h>

#include <atomic>

namespace muster::rendezvous {

bool trim_free_memory(std::size_t threshold) {
#if defined(__GLIBC__)
  // malloc_trim gives back the pages of free chunks but they stay "free" in malloc's
  // figures, so compare with what was free after the last trim: only memory freed since
  // then is worth a trim, and an idle server does not trim again and again.
  static std::atomic<std::size_t> free_after_last_trim{0};
  const std::size_t free_now = ::mallinfo2().fordblks;  // every arena's figures
  std::size_t last = free_after_last_trim.load(std::memory_order_relaxed);
  if (free_now < last) {
    free_after_last_trim.store(free_now, std::memory_order_relaxed);  // reused since
    return false;
  }
  if (free_now - last < threshold) return false;
  ::malloc_trim(0);
  free_after_last_trim.store(::mallinfo2().fordblks, std::memory_order_relaxed);
  return true;
#else
  (void)threshold;
  return false;
#endif
}

}  // namespace muster::rendezvous
