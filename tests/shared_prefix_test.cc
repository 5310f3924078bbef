// FindCommonPrefixes (server/backends/shared_prefix.h): which sequences of a paged call read the same leading
// blocks, and how many, for the backends' cascade decode.
#include "server/backends/shared_prefix.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mha {
namespace {

using ::testing::ElementsAre;

constexpr int64_t kBlockTokens = 16;

// Sequences over fake block addresses: blocks[i] names sequence i's blocks by letter.
class CommonPrefixTest : public ::testing::Test {
 protected:
  void Add(const std::string& blocks, int64_t length, int64_t new_tokens = 1) {
    std::vector<char*> table;
    for (char name : blocks) table.push_back(&storage_[static_cast<unsigned char>(name)]);
    tables_.push_back(table);
    PagedSequence seq;
    seq.length = length;
    seq.new_tokens = new_tokens;
    sequences_.push_back(seq);
  }
  std::vector<CommonPrefix> Find(bool (*eligible)(const PagedSequence&) = [](const PagedSequence&) { return true; }) {
    for (size_t i = 0; i < sequences_.size(); ++i) sequences_[i].blocks = tables_[i];
    return FindCommonPrefixes(sequences_, kBlockTokens, eligible);
  }

  char storage_[128] = {};
  std::vector<std::vector<char*>> tables_;
  std::vector<PagedSequence> sequences_;
};

TEST_F(CommonPrefixTest, SequencesWithTheSameFirstBlockShareTheBlocksAllOfThemHave) {
  Add("ABCx", 60);  // A, B, C full
  Add("ABCy", 64);  // A, B, C, y full
  Add("ABz", 40);   // A, B full
  const std::vector<CommonPrefix> found = Find();
  ASSERT_EQ(found.size(), 1u);
  EXPECT_THAT(found[0].members, ElementsAre(0, 1, 2));
  EXPECT_EQ(found[0].blocks, 2);
}

TEST_F(CommonPrefixTest, APartialBlockIsNotShared) {
  Add("AB", 20);  // B holds 4 tokens: only A is full
  Add("AB", 31);
  const std::vector<CommonPrefix> found = Find();
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].blocks, 1);
}

TEST_F(CommonPrefixTest, LoneSequencesAndCachesWithoutAFullBlockFormNothing) {
  Add("Ax", 40);
  Add("Bx", 40);  // its first block is no one else's
  Add("A", 15);   // no full block
  EXPECT_TRUE(Find().empty());
}

TEST_F(CommonPrefixTest, SeveralSetsAndTheirOwnCommonRuns) {
  Add("ABx", 40);
  Add("CDy", 40);
  Add("ABz", 35);
  Add("CEw", 48);
  const std::vector<CommonPrefix> found = Find();
  ASSERT_EQ(found.size(), 2u);
  const CommonPrefix& ab = found[0].members[0] == 0 ? found[0] : found[1];
  const CommonPrefix& cd = found[0].members[0] == 0 ? found[1] : found[0];
  EXPECT_THAT(ab.members, ElementsAre(0, 2));
  EXPECT_EQ(ab.blocks, 2);
  EXPECT_THAT(cd.members, ElementsAre(1, 3));
  EXPECT_EQ(cd.blocks, 1);
}

bool Decoding(const PagedSequence& s) { return s.new_tokens == 1; }

TEST_F(CommonPrefixTest, OnlyEligibleSequencesCount) {
  Add("ABx", 40, 1);
  Add("ABy", 40, 5);  // not decoding
  Add("ABz", 40, 1);
  const std::vector<CommonPrefix> found = Find(&Decoding);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_THAT(found[0].members, ElementsAre(0, 2));
}

TEST_F(CommonPrefixTest, OneEligibleSequenceFormsNothing) {
  Add("ABx", 40, 1);
  Add("ABy", 40, 5);
  EXPECT_TRUE(Find(&Decoding).empty());
}

}  // namespace
}  // namespace mha
