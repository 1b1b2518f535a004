#include <cstdio>

int main() {
  std::printf("blutrain %s\n", BLU_VERSION);
  return 0;
}
