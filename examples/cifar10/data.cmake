# (placeholder: the data part defines cifar_data and cifar_synth here)
add_library(cifar_data INTERFACE)
