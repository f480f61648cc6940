# The CIFAR-10 CNN (nn.h): model (nn_model.c) on the CPU backend (nn_cpu.c:
# OpenBLAS SGEMM, its own worker threads in nn_pool.c), plus the benchmark
# cnn_bench (build/bin/cnn_bench; bench/compare.sh runs it against PyTorch).
# cifar_nn_gpu holds the CUDA backend (nn_cuda.cu, when PS_CUDA_ENABLED) or
# the stub that says the build has none (nn_cuda_none.c); programs that
# offer --device link it.
#
# Speed flags, on these files only: -O3 and -fno-math-errno (sqrtf inlines
# and vectorizes). No -ffast-math and no -march: the hot loops of nn_cpu.c
# carry target_clones (x86-64-v4 / x86-64-v3 / baseline, picked at load
# time), so one portable binary still runs AVX-512 / AVX2 code where the CPU
# has it.
add_library(cifar_nn STATIC
  ${CMAKE_CURRENT_SOURCE_DIR}/nn_model.c
  ${CMAKE_CURRENT_SOURCE_DIR}/nn_cpu.c
  ${CMAKE_CURRENT_SOURCE_DIR}/nn_pool.c
  ${CMAKE_CURRENT_SOURCE_DIR}/nn_device.c
  ${CMAKE_CURRENT_SOURCE_DIR}/nn_pin.c)
target_include_directories(cifar_nn PUBLIC
  ${CMAKE_CURRENT_SOURCE_DIR}
  ${PROJECT_SOURCE_DIR}/libpsclient/include)
target_compile_options(cifar_nn PRIVATE -O3 -fno-math-errno)
target_link_libraries(cifar_nn PUBLIC PkgConfig::OPENBLAS Threads::Threads m)

if(PS_CUDA_ENABLED)
  add_library(cifar_nn_gpu STATIC ${CMAKE_CURRENT_SOURCE_DIR}/nn_cuda.cu)
  # The project's warning flags are gcc's, which nvcc does not take: this
  # target gets its own (passed to the host compiler).
  set_property(TARGET cifar_nn_gpu PROPERTY COMPILE_OPTIONS "")
  target_compile_options(cifar_nn_gpu PRIVATE -Xcompiler=-Wall,-Wextra
                         -Xcompiler=-Wno-unused-parameter)
  if(PS_WERROR) # host-code warnings and nvcc's own are errors too
    target_compile_options(cifar_nn_gpu PRIVATE -Xcompiler=-Werror
                           --Werror=all-warnings)
  endif()
  set_target_properties(cifar_nn_gpu PROPERTIES CUDA_RUNTIME_LIBRARY Static)
  # cuBLAS is opened at run time (dlopen; see nn_cuda.cu): only its headers
  # here, and the toolkit's library directory as the fallback to search.
  target_compile_definitions(cifar_nn_gpu PRIVATE
    CNN_CUBLAS_DIR="${CUDAToolkit_LIBRARY_DIR}")
  target_link_libraries(cifar_nn_gpu PUBLIC cifar_nn CUDA::cudart_static ${CMAKE_DL_LIBS})
else()
  add_library(cifar_nn_gpu STATIC ${CMAKE_CURRENT_SOURCE_DIR}/nn_cuda_none.c)
  target_link_libraries(cifar_nn_gpu PUBLIC cifar_nn)
endif()

add_executable(cnn_bench ${CMAKE_CURRENT_SOURCE_DIR}/nn_bench.c)
target_compile_options(cnn_bench PRIVATE -O3)
target_link_libraries(cnn_bench PRIVATE cifar_nn_gpu cifar_nn psclient_static
  PkgConfig::PROTOBUFC m)
