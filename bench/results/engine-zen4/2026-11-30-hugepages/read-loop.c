#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <unistd.h>
#include <time.h>
#include <immintrin.h>
#include <omp.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static double readall(const char*p,size_t n){
  double s=0; 
  #pragma omp parallel reduction(+:s)
  { int t=omp_get_thread_num(),T=omp_get_num_threads(); size_t a=n/T*t,b=n/T*(t+1);
    __m512i acc=_mm512_setzero_si512();
    for(size_t i=a;i<b;i+=256){ _mm_prefetch(p+i+8192,_MM_HINT_T0);_mm_prefetch(p+i+8192+64,_MM_HINT_T0);_mm_prefetch(p+i+8192+128,_MM_HINT_T0);_mm_prefetch(p+i+8192+192,_MM_HINT_T0);
      acc=_mm512_add_epi32(acc,_mm512_load_si512(p+i)); acc=_mm512_add_epi32(acc,_mm512_load_si512(p+i+64));
      acc=_mm512_add_epi32(acc,_mm512_load_si512(p+i+128)); acc=_mm512_add_epi32(acc,_mm512_load_si512(p+i+192));}
    s+=_mm512_reduce_add_epi32(acc);}
  return s;}
int main(int c,char**v){
  size_t n=(size_t)1<<30;
  int fd=open("/tmp/hp/blob",O_RDONLY); char*f=mmap(0,n,PROT_READ,MAP_SHARED,fd,0);
  char*a=mmap(0,n,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0); madvise(a,n,MADV_NOHUGEPAGE); memset(a,1,n);
  char*h=aligned_alloc(1<<21,n); madvise(h,n,MADV_HUGEPAGE); memset(h,1,n);
  char*bufs[3]={f,a,h}; const char*names[3]={"file-mmap","anon-4k","anon-thp"};
  for(int i=0;i<3;i++) readall(bufs[i],n);
  for(int r=0;r<8;r++){ for(int i=0;i<3;i++){ double t0=now(); volatile double s=readall(bufs[i],n); double dt=now()-t0; printf("%s %.1f GB/s  ",names[i],n/dt/1e9);} printf("\n"); }
  system("grep AnonHugePages /proc/meminfo");
}
