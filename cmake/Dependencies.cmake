# Finds the Debian packages psd needs; a missing one stops the configure
# step with a message naming the package to install.
find_package(PkgConfig)
if(NOT PKG_CONFIG_FOUND)
  message(FATAL_ERROR "pkg-config not found: install it with `apt-get install pkg-config`")
endif()

function(ps_require_pkg var module package)
  pkg_check_modules(${var} IMPORTED_TARGET ${module})
  if(NOT ${var}_FOUND)
    message(FATAL_ERROR "${module} not found: install it with `apt-get install ${package}`")
  endif()
endfunction()

ps_require_pkg(LIBEVENT libevent libevent-dev)
ps_require_pkg(PROTOBUFC libprotobuf-c libprotobuf-c-dev)
ps_require_pkg(MUNGE munge libmunge-dev)
ps_require_pkg(SODIUM libsodium libsodium-dev)
# Only the CIFAR-10 example computes with BLAS.
if(PS_BUILD_EXAMPLES)
  ps_require_pkg(OPENBLAS openblas libopenblas-dev)
endif()

find_program(PROTOC_C NAMES protoc-c)
if(NOT PROTOC_C)
  message(FATAL_ERROR "protoc-c not found: install it with `apt-get install protobuf-c-compiler`")
endif()

if(PS_BUILD_TESTS)
  pkg_check_modules(CHECK IMPORTED_TARGET check)
  if(NOT CHECK_FOUND)
    message(FATAL_ERROR "check not found: install it with `apt-get install check` (or configure with -DPS_BUILD_TESTS=OFF)")
  endif()
endif()

find_package(Threads REQUIRED)
