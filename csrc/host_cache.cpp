// acshim's CPU tensor allocator: the memory a planned budget promises, at the speed of a cache.
//
// Why it exists. Under `acshim run --budget` glibc serves every allocation over 64 KiB with its own
// mapping (acshim/allocator.py), so the process's resident memory follows what tensors hold and a
// budget measured by RSS holds. The price is a fresh mapping, its page faults and an munmap for
// every activation, every step: a planned step ran at twice the time of the same recipe without the
// setting. glibc has no setting that keeps freed mappings and bounds what it keeps, and torch's CPU
// allocator (c10 DefaultCPUAllocator: posix_memalign / free) has none either; the CUDA caching
// allocator's reserved memory is the model (c10/cuda/CUDACachingAllocator.cpp), so this one is
// hand-written in its spirit, kept small:
//
// - Blocks of at least kLargeBytes are mappings of whole pages. A freed block whose pages are all
//   resident is cached (not unmapped) and served again to a request of its size in pages.
// - What the allocator has mapped (its "reserved" bytes: tensors' blocks and the cache) never
//   exceeds the most its tensors ever held at once since the cache was enabled (its "peak"), plus
//   an optional slack: a request that would pass that first unmaps cached blocks, largest first.
//   So the process holds no more than with a fresh mapping per tensor (except that a cached block is
//   resident when handed out, a fresh mapping only as it is written), and a training loop whose
//   steps repeat their sizes is served from the cache from the second step on.
// - Smaller blocks come from malloc (posix_memalign), as torch's default allocator does.
// - Every block is reported to torch's profiler as the default allocator reports it
//   (c10::profiledCPUMemoryReporter), so torch.profiler(profile_memory=True) still sees them.
//
// Counters (allocated, reserved, cached, peaks, hits, misses, mapped and unmapped bytes) are what a
// planner reads instead of sampling the process. Blocks freed after uninstall() are unmapped; the
// allocator object lives as long as the process (tensors may outlive the Python module).

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <pybind11/pybind11.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <pthread.h>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kLargeBytes = 65536;  // the glibc mmap threshold acshim/allocator.py sets
constexpr size_t kAlignment = 64;      // c10's gAlignment

struct Counters {
  size_t allocated = 0;       // bytes in blocks tensors hold (large and small)
  size_t peak_allocated = 0;  // since the last reset_peak()
  size_t mapped = 0;          // large blocks mapped: held and cached
  size_t cached = 0;          // large blocks freed and kept
  size_t peak_mapped = 0;     // since the last reset_peak()
  size_t held_high = 0;       // the bound on `mapped`: large bytes held at most since enable()
  uint64_t hits = 0, misses = 0, maps = 0, unmaps = 0;
};

class HostCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nullptr;
    if (nbytes == 0) {
      return {nullptr, nullptr, &Delete, c10::Device(c10::DeviceType::CPU)};
    }
    if (nbytes < kLargeBytes) {
      ptr = AllocateSmall(nbytes);
    } else {
      ptr = AllocateLarge(nbytes);
    }
    c10::profiledCPUMemoryReporter().New(ptr, nbytes);
    return {ptr, ptr, &Delete, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void Delete(void* ptr) {
    if (ptr == nullptr) return;
    c10::profiledCPUMemoryReporter().Delete(ptr);
    Instance().Free(ptr);
  }

  static HostCache& Instance() {
    static HostCache* instance = new HostCache();  // never destroyed: tensors may be freed at exit
    return *instance;
  }

  void Enable(size_t slack) {
    std::lock_guard<std::mutex> lock(mutex_);
    caching_ = true;
    slack_ = slack;
    c_.held_high = large_held_;
  }

  // Stop caching and unmap what is cached; blocks still held are unmapped when freed.
  void Disable() {
    std::lock_guard<std::mutex> lock(mutex_);
    caching_ = false;
    TrimLocked(0);
  }

  // Unmap every cached block and bound what is mapped from here by what tensors hold from here:
  // a measurement that starts after this sees the process hold what its tensors hold.
  size_t Release() {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t before = c_.cached;
    TrimLocked(0);
    c_.held_high = large_held_;
    return before;
  }

  size_t Cached() {
    std::lock_guard<std::mutex> lock(mutex_);
    return c_.cached;
  }

  void ResetPeak() {
    std::lock_guard<std::mutex> lock(mutex_);
    c_.peak_allocated = c_.allocated;
    c_.peak_mapped = c_.mapped;
  }

  Counters Snapshot() {
    std::lock_guard<std::mutex> lock(mutex_);
    return c_;
  }

  bool caching() {
    std::lock_guard<std::mutex> lock(mutex_);
    return caching_;
  }

  std::mutex mutex_;  // public for the fork handlers

 private:
  static size_t RoundToPages(size_t nbytes) {
    static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return (nbytes + page - 1) / page * page;
  }

  void* AllocateSmall(size_t nbytes) {
    void* ptr = nullptr;
    if (posix_memalign(&ptr, kAlignment, nbytes) != 0 || ptr == nullptr) {
      c10::profiledCPUMemoryReporter().OutOfMemory(nbytes);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "acshim host cache: DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate ", nbytes, " bytes. Error code ", errno, " (", strerror(errno), ")");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    Account(nbytes);
    small_[ptr] = nbytes;
    return ptr;
  }

  void* AllocateLarge(size_t nbytes) {
    const size_t size = RoundToPages(nbytes);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // a cached block of exactly this size (a larger one would hold pages a mapping per tensor
      // would not: the bound would let the cache keep that much more)
      auto found = free_.find(size);
      if (found != free_.end()) {
        void* ptr = found->second;
        const size_t block = found->first;
        free_.erase(found);
        c_.cached -= block;
        c_.hits += 1;
        large_[ptr] = block;
        large_held_ += block;
        Account(block);
        c_.held_high = std::max(c_.held_high, large_held_);
        return ptr;
      }
      c_.misses += 1;
      if (caching_) {
        // the bound: what is mapped stays within the most ever held (counting this block) plus slack
        const size_t bound = std::max(c_.held_high, large_held_ + size) + slack_;
        if (c_.mapped + size > bound) TrimLocked(c_.mapped + size - bound);
      }
    }
    void* ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        TrimLocked(c_.cached);  // give back every cached block and try once more
      }
      ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (ptr == MAP_FAILED) {
        c10::profiledCPUMemoryReporter().OutOfMemory(nbytes);
        TORCH_CHECK_WITH(OutOfMemoryError, false, "acshim host cache: DefaultCPUAllocator: can't allocate memory: "
                         "you tried to allocate ", nbytes, " bytes. Error code ", errno, " (", strerror(errno), ")");
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    c_.maps += 1;
    c_.mapped += size;
    c_.peak_mapped = std::max(c_.peak_mapped, c_.mapped);
    large_[ptr] = size;
    large_held_ += size;
    c_.held_high = std::max(c_.held_high, large_held_);
    Account(size);
    return ptr;
  }

  void Account(size_t bytes) {
    c_.allocated += bytes;
    c_.peak_allocated = std::max(c_.peak_allocated, c_.allocated);
  }

  void Free(void* ptr) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto large = large_.find(ptr);
    if (large != large_.end()) {
      const size_t size = large->second;
      large_.erase(large);
      large_held_ -= size;
      c_.allocated -= size;
      const bool caching = caching_;
      lock.unlock();
      const size_t resident = caching ? Resident(ptr, size) : size;
      lock.lock();
      if (caching && resident == size && caching_) {
        free_.emplace(size, ptr);
        c_.cached += size;
        return;
      }
      if (caching) {
        // a sparse block counted whole in the bound: the most held was at most that less its
        // untouched pages (pages are only ever added to a block while it is held)
        c_.held_high = std::max(large_held_, c_.held_high - std::min(c_.held_high, size - resident));
      }
      c_.mapped -= size;
      c_.unmaps += 1;
      lock.unlock();
      munmap(ptr, size);
      return;
    }
    auto small = small_.find(ptr);
    if (small != small_.end()) {
      c_.allocated -= small->second;
      small_.erase(small);
    }
    lock.unlock();
    free(ptr);
  }

  // Bytes of a block's pages that are resident (mincore(2)). A block tensors never wrote in full (a
  // torch.empty scratch buffer written a page per row) is not cached: the cache's bytes would then
  // overstate what it holds, and the bound, counted in whole blocks, would overstate what was held.
  static size_t Resident(void* ptr, size_t size) {
    static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    thread_local std::vector<unsigned char> pages;
    pages.resize(size / page);
    if (mincore(ptr, size, pages.data()) != 0) return 0;  // not known: not cached
    size_t resident = 0;
    for (unsigned char flag : pages) resident += (flag & 1) ? page : 0;
    return resident;
  }

  // Unmap cached blocks, largest first, until at least `bytes` are given back (or none is left).
  void TrimLocked(size_t bytes) {
    size_t freed = 0;
    while (!free_.empty() && (bytes == 0 || freed < bytes)) {
      auto last = std::prev(free_.end());
      munmap(last->second, last->first);
      freed += last->first;
      c_.cached -= last->first;
      c_.mapped -= last->first;
      c_.unmaps += 1;
      free_.erase(last);
    }
  }

  bool caching_ = false;
  size_t slack_ = 0;
  size_t large_held_ = 0;
  Counters c_;
  std::multimap<size_t, void*> free_;
  std::unordered_map<void*, size_t> large_;
  std::unordered_map<void*, size_t> small_;
};

c10::Allocator* g_previous = nullptr;
bool g_installed = false;
constexpr uint8_t kPriority = 1;  // above c10's DefaultCPUAllocator (registered at 0)

void ForkPrepare() { HostCache::Instance().mutex_.lock(); }
void ForkParent() { HostCache::Instance().mutex_.unlock(); }
// A forked child (a DataLoader worker) starts with no cache and a bound of what it holds: the
// parent's cached blocks and its most held are the parent's.
void ForkChild() {
  HostCache::Instance().mutex_.unlock();
  HostCache::Instance().Release();
}

// Make this the CPU allocator; blocks are mapped per tensor (no cache) until enable_cache().
bool Install() {
  static bool handlers = false;
  if (!handlers) {
    pthread_atfork(&ForkPrepare, &ForkParent, &ForkChild);
    handlers = true;
  }
  HostCache& cache = HostCache::Instance();
  if (!g_installed) {
    g_previous = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&cache, kPriority);
    g_installed = c10::GetCPUAllocator() == &cache;  // another allocator set at a higher priority stays
  }
  return g_installed;
}

void Uninstall() {
  HostCache& cache = HostCache::Instance();
  if (g_installed) {
    c10::SetCPUAllocator(g_previous, kPriority);
    g_installed = false;
  }
  cache.Disable();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "acshim's CPU tensor allocator with a bounded cache of freed mappings";
  m.def("install", &Install, "Make this the CPU allocator (torch's is restored by uninstall); False if not.");
  m.def("enable_cache", [](size_t slack) { HostCache::Instance().Enable(slack); }, pybind11::arg("slack") = 0,
        "Keep freed blocks, mapped bytes bounded by the most held since (plus slack).");
  m.def("caching", []() { return HostCache::Instance().caching(); });
  m.def("cached", []() { return HostCache::Instance().Cached(); }, "Bytes in freed blocks kept mapped.");
  m.def("uninstall", &Uninstall, "Restore the previous CPU allocator and unmap the cache.");
  m.def("installed", []() { return g_installed; });
  m.def("release", []() { return HostCache::Instance().Release(); },
        "Unmap every cached block (returns their bytes) and bound the cache by what is held from now.");
  m.def("reset_peak", []() { HostCache::Instance().ResetPeak(); });
  m.def("stats", []() {
    Counters c = HostCache::Instance().Snapshot();
    pybind11::dict d;
    d["allocated"] = c.allocated;
    d["peak_allocated"] = c.peak_allocated;
    d["mapped"] = c.mapped;
    d["peak_mapped"] = c.peak_mapped;
    d["cached"] = c.cached;
    d["bound"] = c.held_high;
    d["hits"] = c.hits;
    d["misses"] = c.misses;
    d["maps"] = c.maps;
    d["unmaps"] = c.unmaps;
    return d;
  });
}
