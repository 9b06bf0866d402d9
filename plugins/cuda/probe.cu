// The device-side object every CUDA build of the custom-op library links (with the CUDA runtime linked statically,
// so no libcudart in NEEDED): what the glue asks of the CUDA runtime itself. The kernels are the generated
// instances, further objects linked the same way (onnx_gtco/plugin/library.py).
#include <cuda_runtime.h>

// Number of CUDA devices the runtime sees, or -(cudaError_t) when it cannot tell (e.g. 35,
// cudaErrorInsufficientDriver, on a machine without a driver).
extern "C" __attribute__((visibility("default"))) int gtco_cuda_device_count() {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    return err == cudaSuccess ? n : -static_cast<int>(err);
}

// Compute capability of the calling thread's current device as major * 10 + minor, or -(cudaError_t). The glue
// picks each node's instance (sm_80 or sm_90 build) with it when ORT creates the node's kernel.
extern "C" __attribute__((visibility("default"))) int gtco_device_cc() {
    int dev = 0, major = 0, minor = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    return err == cudaSuccess ? major * 10 + minor : -static_cast<int>(err);
}
