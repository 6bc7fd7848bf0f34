/* yardstick.cu: the device's own figures, for scripts/gpu-check to set the engine's against:
 * device-to-device copy bandwidth (bytes read + written per second, best of 10 copies of a
 * 1 GiB buffer) and cuBLAS half-precision GEMM throughput (4096^3, f32 accumulation; the
 * rate the engine's prefill does not aim at, since its own kernels keep batch invariance).
 * Prints "copy_gb_s X" and "cublas_tflop_s Y"; exits 1 without a device. */
#include <cstdio>
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define TRY(call)                                                                         \
    do {                                                                                  \
        cudaError_t e_ = (call);                                                          \
        if (e_ != cudaSuccess) {                                                          \
            fprintf(stderr, "tinyloop-cuda-yardstick: %s: %s\n", #call, cudaGetErrorString(e_)); \
            return 1;                                                                     \
        }                                                                                 \
    } while (0)

int main() {
    const size_t bytes = (size_t)1 << 30;
    void *a = nullptr, *b = nullptr;
    TRY(cudaMalloc(&a, bytes));
    TRY(cudaMalloc(&b, bytes));
    TRY(cudaMemset(a, 1, bytes));
    cudaEvent_t start, stop;
    TRY(cudaEventCreate(&start));
    TRY(cudaEventCreate(&stop));
    float best_ms = 1e30f;
    for (int i = 0; i < 10; i++) {
        TRY(cudaEventRecord(start));
        TRY(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
        TRY(cudaEventRecord(stop));
        TRY(cudaEventSynchronize(stop));
        float ms;
        TRY(cudaEventElapsedTime(&ms, start, stop));
        if (ms < best_ms) best_ms = ms;
    }
    printf("copy_gb_s %.1f\n", 2.0 * (double)bytes / (best_ms * 1e-3) / 1e9);

    const int n = 4096;
    cublasHandle_t handle;
    if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "tinyloop-cuda-yardstick: cublasCreate failed\n");
        return 1;
    }
    const float one = 1.0f, zero = 0.0f;
    best_ms = 1e30f;
    for (int i = 0; i < 10; i++) {
        TRY(cudaEventRecord(start));
        if (cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16F, n, a, CUDA_R_16F, n, &zero, b,
                         CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "tinyloop-cuda-yardstick: cublasGemmEx failed\n");
            return 1;
        }
        TRY(cudaEventRecord(stop));
        TRY(cudaEventSynchronize(stop));
        float ms;
        TRY(cudaEventElapsedTime(&ms, start, stop));
        if (ms < best_ms) best_ms = ms;
    }
    printf("cublas_tflop_s %.1f\n", 2.0 * n * (double)n * n / (best_ms * 1e-3) / 1e12);
    cublasDestroy(handle);
    cudaFree(a);
    cudaFree(b);
    return 0;
}
