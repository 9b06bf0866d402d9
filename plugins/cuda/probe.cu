// Placeholder device-side object of the custom-op library, built by nvcc when the library is built with cuda=True.
// It holds no kernel yet: it proves that an nvcc object links into the g++-built glue with the CUDA runtime
// linked statically (no libcudart in NEEDED), and gives a diagnostic entry point. The generated LayerNorm (and
// later) instances will be further .cu objects linked the same way (see onnx_gtco/plugin/library.py).
#include <cuda_runtime.h>

// Number of CUDA devices the runtime sees, or -(cudaError_t) when it cannot tell (e.g. 35,
// cudaErrorInsufficientDriver, on a machine without a driver).
extern "C" __attribute__((visibility("default"))) int gtco_cuda_device_count() {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    return err == cudaSuccess ? n : -static_cast<int>(err);
}
