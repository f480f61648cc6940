# The CIFAR-10 CNN (nn.h): model (nn_model.c) on the CPU backend (nn_cpu.c:
# OpenBLAS SGEMM + OpenMP threads), plus the benchmark cnn_bench.
#
# Speed flags, on these files only: -O3 and -fno-math-errno (sqrtf
# inlines and vectorizes); no -ffast-math, no -march: the hot element-wise
# functions of nn_cpu.c carry target_clones (x86-64-v3 / v4 / default), so
# one portable binary still runs AVX2/AVX-512 loops where the CPU has them.
add_library(cifar_nn STATIC
  ${CMAKE_CURRENT_SOURCE_DIR}/nn_model.c
  ${CMAKE_CURRENT_SOURCE_DIR}/nn_cpu.c)
target_include_directories(cifar_nn PUBLIC
  ${CMAKE_CURRENT_SOURCE_DIR}
  ${PROJECT_SOURCE_DIR}/libpsclient/include)
target_compile_options(cifar_nn PRIVATE -O3 -fno-math-errno)
target_link_libraries(cifar_nn PUBLIC PkgConfig::OPENBLAS Threads::Threads m)
find_package(OpenMP COMPONENTS C)
if(OpenMP_C_FOUND)
  target_link_libraries(cifar_nn PUBLIC OpenMP::OpenMP_C)
else()
  message(STATUS "cifar_nn: no OpenMP, the CPU backend runs on one thread")
  target_compile_options(cifar_nn PRIVATE -Wno-unknown-pragmas)
endif()

add_executable(cnn_bench ${CMAKE_CURRENT_SOURCE_DIR}/nn_bench.c)
target_compile_options(cnn_bench PRIVATE -O3)
target_link_libraries(cnn_bench PRIVATE cifar_nn psclient_static
  PkgConfig::PROTOBUFC m)
