#include "memory_trim.h"

#include <malloc.h>

namespace muster::rendezvous {

bool trim_free_memory(std::size_t threshold) {
#if defined(__GLIBC__)
  struct mallinfo2 info = ::mallinfo2();  // every arena's figures
  if (info.fordblks < threshold) return false;
  ::malloc_trim(0);
  return true;
#else
  (void)threshold;
  return false;
#endif
}

}  // namespace muster::rendezvous
