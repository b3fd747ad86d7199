# Self-contained binaries (docs/install.md, "What the binaries need"): with
# MUSTER_STATIC_DEPS (on by default) every library of ours that has a static archive
# (gRPC, protobuf, abseil, OpenSSL, c-ares, re2, zlib) is linked from it, and spdlog and
# fmt, which Debian ships shared only, are compiled in from their headers. `launch` and
# `rdzvd` also take libstdc++ in and are linked as fixed-address executables
# (muster_self_contained below): what is left for the dynamic loader is glibc's, and the
# start pays no relocation of the program's own tables (issue 43: start-up at the floor).
#
# Include after the find_package calls; it rewrites the imported targets of this directory.
option(MUSTER_STATIC_DEPS "Link the dependencies statically into the binaries" ON)

# spdlog as the project links it: the shared library, or (static) its header-only form on
# header-only fmt.
add_library(muster_spdlog INTERFACE)
if(MUSTER_STATIC_DEPS)
  get_target_property(spdlog_include spdlog::spdlog_header_only INTERFACE_INCLUDE_DIRECTORIES)
  if(spdlog_include)
    target_include_directories(muster_spdlog SYSTEM INTERFACE ${spdlog_include})
  endif()
  target_compile_definitions(muster_spdlog INTERFACE SPDLOG_FMT_EXTERNAL FMT_HEADER_ONLY=1)
  target_link_libraries(muster_spdlog INTERFACE Threads::Threads)
else()
  target_link_libraries(muster_spdlog INTERFACE spdlog::spdlog)
endif()

if(MUSTER_STATIC_DEPS)
  get_directory_property(muster_imported IMPORTED_TARGETS)
  set(muster_still_shared "")
  foreach(t IN LISTS muster_imported)
    get_target_property(type ${t} TYPE)
    if(type STREQUAL "INTERFACE_LIBRARY")
      # re2 comes from pkg-config as a bare library name.
      get_target_property(libs ${t} INTERFACE_LINK_LIBRARIES)
      if(libs AND (libs MATCHES "(^|;)(-l)?re2(;|$)"))
        find_library(MUSTER_RE2_STATIC NAMES libre2.a)
        if(MUSTER_RE2_STATIC)
          string(REGEX REPLACE "(^|;)(-l)?re2(;|$)" "\\1${MUSTER_RE2_STATIC}\\3" libs "${libs}")
          set_target_properties(${t} PROPERTIES INTERFACE_LINK_LIBRARIES "${libs}")
        endif()
      endif()
      continue()
    endif()
    if(NOT (type STREQUAL "SHARED_LIBRARY" OR type STREQUAL "UNKNOWN_LIBRARY"))
      continue()
    endif()
    if(t MATCHES "^(spdlog::|fmt::)")
      continue()  # replaced by muster_spdlog above
    endif()
    foreach(prop IMPORTED_LOCATION IMPORTED_LOCATION_NONE IMPORTED_LOCATION_NOCONFIG
                 IMPORTED_LOCATION_RELEASE IMPORTED_LOCATION_RELWITHDEBINFO
                 IMPORTED_LOCATION_DEBUG)
      get_target_property(loc ${t} ${prop})
      if(NOT loc OR NOT loc MATCHES "\\.so(\\.[0-9.]+)?$")
        continue()
      endif()
      string(REGEX REPLACE "\\.so(\\.[0-9.]+)?$" ".a" archive "${loc}")
      if(EXISTS "${archive}")
        set_target_properties(${t} PROPERTIES ${prop} "${archive}")
      else()
        list(APPEND muster_still_shared "${loc}")
      endif()
    endforeach()
  endforeach()
  if(muster_still_shared)
    list(REMOVE_DUPLICATES muster_still_shared)
    message(STATUS "muster: no static archive, linked shared: ${muster_still_shared}")
  endif()
endif()

# launch and rdzvd: libstdc++ linked in, a fixed-address (non-PIE) executable. libgcc_s stays
# shared (every system has it, and the static unwinder of GCC 12 needs glibc 2.35's
# _dl_find_object); glibc_compat.cc keeps libstdc++'s one newer glibc call out.
function(muster_self_contained target)
  if(MUSTER_STATIC_DEPS)
    target_sources(${target} PRIVATE ${PROJECT_SOURCE_DIR}/cmake/glibc_compat.cc)
    target_link_options(${target} PRIVATE -static-libstdc++ -no-pie)
  endif()
endfunction()
