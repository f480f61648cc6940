# (placeholder: the nn part defines cifar_nn here)
add_library(cifar_nn INTERFACE)
