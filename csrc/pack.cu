// acshim CUDA pack kernels: gather many small saved tensors into one contiguous buffer (one transfer
// instead of many tiny ones) and scatter them back. Built only where CUDA is present
// (acshim/storage/native.py); the Python fallback (torch.cat of byte views / narrow+copy_) gives
// the same bytes. Each block walks one segment with a grid-stride loop over bytes.

#include <cuda_runtime.h>
#include <cstdint>

namespace acshim {

__global__ void gather_kernel(const std::int64_t* sources, const std::int64_t* sizes,
                              const std::int64_t* offsets, unsigned char* packed) {
  const auto segment = blockIdx.x;
  const auto* source = reinterpret_cast<const unsigned char*>(sources[segment]);
  unsigned char* target = packed + offsets[segment];
  for (std::int64_t i = threadIdx.x; i < sizes[segment]; i += blockDim.x) target[i] = source[i];
}

__global__ void scatter_kernel(const unsigned char* packed, const std::int64_t* targets,
                               const std::int64_t* sizes, const std::int64_t* offsets) {
  const auto segment = blockIdx.x;
  auto* target = reinterpret_cast<unsigned char*>(targets[segment]);
  const unsigned char* source = packed + offsets[segment];
  for (std::int64_t i = threadIdx.x; i < sizes[segment]; i += blockDim.x) target[i] = source[i];
}

// table: device int64 tensor of shape [3, n] = (addresses, sizes, offsets) of the n segments.
void launch_gather(const std::int64_t* table, int n, unsigned char* packed, cudaStream_t stream) {
  if (n > 0) gather_kernel<<<n, 256, 0, stream>>>(table, table + n, table + 2 * n, packed);
}

void launch_scatter(const unsigned char* packed, const std::int64_t* table, int n, cudaStream_t stream) {
  if (n > 0) scatter_kernel<<<n, 256, 0, stream>>>(packed, table, table + n, table + 2 * n);
}

}  // namespace acshim
