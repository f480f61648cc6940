# CIFAR-10 data: the library cifar_data (binary loader, per-worker sampler
# with random crop/flip augmentation, per-image standardization, evaluation
# batches, the background prefetcher of prefetch.h) and the tool
# cifar_synth (writes a synthetic data set in the binary format, for tests
# and users without the real data).
add_library(cifar_data STATIC ${CMAKE_CURRENT_SOURCE_DIR}/data.c
  ${CMAKE_CURRENT_SOURCE_DIR}/prefetch.c)
target_include_directories(cifar_data PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(cifar_data PUBLIC Threads::Threads m)

add_executable(cifar_synth ${CMAKE_CURRENT_SOURCE_DIR}/cifar_synth.c)
if(PS_INSTALL_EXAMPLES) # -DPS_INSTALL_EXAMPLES=ON
  install(TARGETS cifar_synth RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
# The cifar_data tests run build/bin/cifar_synth: whatever links cifar_data
# (the test runner) gets the tool built first.
add_dependencies(cifar_data cifar_synth)
