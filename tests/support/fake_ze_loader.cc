// A stand-in for Level Zero's loader (libze_loader.so.1), for the test of
// `launch --nproc_per_node=xpu`: zeInit succeeds, one driver, $FAKE_ZE_DEVICES devices.
#include <cstdint>
#include <cstdlib>

extern "C" {

int zeInit(unsigned /*flags*/) { return 0; }

int zeDriverGet(std::uint32_t* count, void** drivers) {
  if (drivers != nullptr && *count >= 1) drivers[0] = reinterpret_cast<void*>(0x1);
  *count = 1;
  return 0;
}

int zeDeviceGet(void* /*driver*/, std::uint32_t* count, void** /*devices*/) {
  const char* n = std::getenv("FAKE_ZE_DEVICES");
  *count = n != nullptr ? static_cast<std::uint32_t>(std::atoi(n)) : 0;
  return 0;
}
}
