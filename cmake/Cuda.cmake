# The CUDA backend of the CIFAR-10 example (examples/cifar10/nn_cuda.cu),
# per PS_CUDA: AUTO builds it when a CUDA toolkit is found (nvcc on PATH, in
# CUDACXX / CMAKE_CUDA_COMPILER, or /usr/local/cuda/bin/nvcc), ON requires
# one, OFF leaves it out. Sets PS_CUDA_ENABLED. Code: sm_90 SASS (H100)
# plus compute_90 PTX, which the driver compiles for newer GPUs.
set(PS_CUDA_ENABLED OFF)
if(PS_SANITIZE OR PS_FUZZ)
  # The sanitizer and fuzz builds test the C code. The CUDA runtime does not
  # start under ASan's default shadow layout (it needs protect_shadow_gap=0),
  # nvcc does not take clang's -fsanitize=fuzzer flags, and there is no GPU
  # in CI to run it on anyway. The kernels' per-element bodies still run on
  # the CPU there (tests/test_cuda_ops.c is plain C).
  if(PS_CUDA STREQUAL "ON")
    message(FATAL_ERROR "PS_CUDA=ON cannot be combined with PS_SANITIZE or PS_FUZZ "
      "(the CUDA runtime does not run under the sanitizers): use PS_CUDA=OFF or AUTO")
  endif()
  message(STATUS "CUDA backend: off (sanitizer or fuzz build)")
elseif(PS_CUDA STREQUAL "OFF")
  message(STATUS "CUDA backend: off (PS_CUDA=OFF)")
else()
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc CACHE FILEPATH "CUDA compiler")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90-real 90-virtual)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(PS_CUDA_ENABLED ON)
    message(STATUS "CUDA backend: on (${CMAKE_CUDA_COMPILER}, CUDA ${CUDAToolkit_VERSION}, "
      "architectures ${CMAKE_CUDA_ARCHITECTURES})")
  elseif(PS_CUDA STREQUAL "ON")
    message(FATAL_ERROR "PS_CUDA=ON but no CUDA compiler was found: install the CUDA "
      "toolkit (/usr/local/cuda) or pass -DCMAKE_CUDA_COMPILER=/path/to/nvcc")
  else()
    message(STATUS "CUDA backend: off (no CUDA toolkit found; -DCMAKE_CUDA_COMPILER=... to use one)")
  endif()
endif()
