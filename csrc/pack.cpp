// Python binding of the CUDA pack kernels (pack.cu). Built only where CUDA is present.
//   gather(tensors) -> packed: one uint8 device tensor holding every (contiguous) tensor's bytes,
//     back to back in order.
//   scatter(packed, tensors): copy the bytes back into tensors of the same sizes, in order.
// Both run on the current CUDA stream, like the torch ops they replace (torch.cat / copy_).

#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

#include <vector>

namespace acshim {
void launch_gather(const std::int64_t* table, int n, unsigned char* packed, cudaStream_t stream);
void launch_scatter(const unsigned char* packed, const std::int64_t* table, int n, cudaStream_t stream);
}

namespace {

torch::Tensor segment_table(const std::vector<torch::Tensor>& tensors, std::int64_t* total) {
  const auto n = static_cast<std::int64_t>(tensors.size());
  auto table = torch::empty({3, n}, torch::kInt64);
  auto* rows = table.data_ptr<std::int64_t>();
  std::int64_t offset = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(tensors[i].is_cuda() && tensors[i].is_contiguous(), "pack: tensor ", i, " must be a contiguous CUDA tensor");
    const auto bytes = tensors[i].numel() * tensors[i].element_size();
    rows[i] = reinterpret_cast<std::int64_t>(tensors[i].data_ptr());
    rows[n + i] = bytes;
    rows[2 * n + i] = offset;
    offset += bytes;
  }
  *total = offset;
  return table;
}

torch::Tensor gather(const std::vector<torch::Tensor>& tensors) {
  TORCH_CHECK(!tensors.empty(), "pack.gather needs at least one tensor");
  std::int64_t total = 0;
  auto table = segment_table(tensors, &total).to(tensors[0].device(), /*non_blocking=*/false);
  auto packed = torch::empty({total}, tensors[0].options().dtype(torch::kUInt8));
  acshim::launch_gather(table.data_ptr<std::int64_t>(), static_cast<int>(tensors.size()),
                        packed.data_ptr<unsigned char>(), at::cuda::getCurrentCUDAStream());
  return packed;
}

void scatter(const torch::Tensor& packed, const std::vector<torch::Tensor>& tensors) {
  std::int64_t total = 0;
  auto table = segment_table(tensors, &total).to(packed.device(), /*non_blocking=*/false);
  TORCH_CHECK(packed.numel() == total, "pack.scatter: packed has ", packed.numel(), " bytes, tensors need ", total);
  acshim::launch_scatter(packed.data_ptr<unsigned char>(), table.data_ptr<std::int64_t>(),
                         static_cast<int>(tensors.size()), at::cuda::getCurrentCUDAStream());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "acshim CUDA pack kernels: many small tensors in one transfer";
  m.def("gather", &gather, "Pack contiguous CUDA tensors into one uint8 buffer.");
  m.def("scatter", &scatter, "Unpack a buffer from gather back into tensors of the same sizes.");
}
